# The smg-mlx worker for Linux containers: MLX's CPU backend by default, its CUDA backend
# for NVIDIA GPUs with --build-arg MLX_EXTRA=cuda13 (the CUDA libraries come as Python
# packages; the driver comes from the host, through the NVIDIA Container Toolkit).
#   docker build -t smg-mlx:0.1.0-cpu .
#   docker build --build-arg MLX_EXTRA=cuda13 -t smg-mlx:0.1.0-cuda13 .
# deploy/README.md ("Containers") says how to run it and how it fits the Kubernetes manifest.
FROM python:3.12-slim-bookworm AS build
ARG MLX_EXTRA=cpu
COPY . /src
# The same install as the systemd recipe's, into the same prefix in both stages (a virtual
# environment cannot move).
RUN PIP_ROOT_USER_ACTION=ignore /src/deploy/install.sh /opt/smg-mlx "$MLX_EXTRA"

FROM python:3.12-slim-bookworm
COPY --from=build /opt/smg-mlx /opt/smg-mlx
# A fixed, non-root UID: Kubernetes' runAsNonRoot can only verify a numeric user. Its home
# holds the Hugging Face cache (a volume: downloads outlive the container) and the demo model.
RUN useradd --uid 10001 --create-home --home-dir /var/lib/smg-mlx --shell /usr/sbin/nologin \
        smg-mlx \
    && install -d -o smg-mlx -g smg-mlx /var/lib/smg-mlx/huggingface
# The volume also keeps the kernels mlx's CUDA backend compiles on first use: a restarted
# container then starts in seconds instead of compiling them again (docs/serving.md,
# "Scheduling").
ENV PATH=/opt/smg-mlx/bin:$PATH \
    HF_HOME=/var/lib/smg-mlx/huggingface \
    MLX_PTX_CACHE_DIR=/var/lib/smg-mlx/huggingface/mlx-ptx
VOLUME /var/lib/smg-mlx/huggingface
USER 10001
WORKDIR /var/lib/smg-mlx
EXPOSE 50051 9400
# For docker and compose; Kubernetes uses the manifest's native gRPC probes on the same port.
HEALTHCHECK --interval=10s --timeout=6s --start-period=10m \
    CMD ["smg-mlx", "health", "--port", "50051", "--timeout", "5"]
ENTRYPOINT ["smg-mlx"]
# A model to try it with; the Kubernetes manifest, or arguments to `docker run`, name yours.
CMD ["serve", "--demo", "--host", "0.0.0.0", "--port", "50051"]
