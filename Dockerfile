# The gpusteward image: one entry point for every process (worker, collectors,
# watcher, consumers, report, simulator), chosen by the command's arguments.
# Build: docker build -t gpusteward:dev .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpusteward ./gpusteward
COPY collectors ./collectors
COPY streams ./streams
COPY rules ./rules
COPY alerting ./alerting
COPY remediation ./remediation
COPY reports ./reports
# The simulated world ships too (compose's demo profile runs the simulator);
# production code never imports it.
COPY sandbox ./sandbox
RUN pip install . && rm -rf /src

# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it and volumes can
# be given to it with fsGroup.
RUN groupadd --system --gid 10001 gpusteward \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/gpusteward \
      --create-home --shell /usr/sbin/nologin gpusteward
USER 10001:10001
WORKDIR /var/lib/gpusteward

ENTRYPOINT ["gpusteward"]
CMD ["--help"]
