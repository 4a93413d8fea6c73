# A stand-in for nginx:1.29-alpine (compose.cluster.yaml's load balancer): Debian's nginx in the
# foreground, wget for the health probe; the config is mounted at /etc/nginx/nginx.conf.
ARG BASE=lorafleet-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx wget \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
EXPOSE 8000
CMD ["nginx", "-g", "daemon off;"]
