#!/bin/sh
# The serving images' entrypoint: pull the artifact this container serves, then exec its server with the
# arguments the manifest records plus this container's own ("$@", e.g. --host 0.0.0.0 --port 8080).
# `hive-aot serve` verifies every blob, leaves DIR complete or absent, and replaces itself with the server, so
# the server is process 1 and gets the container's signals (pipelines/client/serve.py).
#   HIVE_AOT_MODEL      org/name or org/name@build_id (required)
#   HIVE_AOT_TARGET     runtime profile id, or auto (default: detect the accelerator)
#   HIVE_AOT_RECIPE     a recipe among those serving the profile (default: the registry's preference)
#   HIVE_AOT_TAG        default latest
#   HIVE_AOT_MODEL_DIR  where the model goes (default /models/model)
#   HIVE_AOT_STORE, HIVE_AOT_CACHE, AWS_*, HIVE_AOT_TRUSTED_KEYS: as for `hive-aot pull`
set -eu
: "${HIVE_AOT_MODEL:?set HIVE_AOT_MODEL to org/name[@build_id]}"
set -- --target "${HIVE_AOT_TARGET:-auto}" --dest "${HIVE_AOT_MODEL_DIR:-/models/model}" \
    --tag "${HIVE_AOT_TAG:-latest}" ${HIVE_AOT_RECIPE:+--recipe "$HIVE_AOT_RECIPE"} -- "$@"
exec hive-aot serve "$HIVE_AOT_MODEL" "$@"
