# A stand-in for redis:7.4-alpine: Debian's redis-server, run as user redis with uid 999 as in the
# official image (compose_init hands the Redis password file to that uid), data in /data.
ARG BASE=lorafleet-base:bookworm
FROM ${BASE}
RUN groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid 999 --home-dir /data --no-create-home redis \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
