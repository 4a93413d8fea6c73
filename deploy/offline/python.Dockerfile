# A stand-in for python:3.11-slim built from Debian bookworm's packages (its python3 is 3.11), for a
# machine that reaches Debian's mirror but no container registry. build.sh tags it python:3.11-slim.
# python3-dev and g++: the worker's native kernels are compiled against Python.h.
ARG BASE=lorafleet-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev g++ ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python
ENV LANG=C.UTF-8
CMD ["python3"]
