# Image for the gpuledger services in compose.yaml (and deploy/k8s).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["gpuledger", "--help"]
