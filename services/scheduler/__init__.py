"""Admission, fairness and placement of requests on workers."""
