"""The platform defaults shipped in the package: registry.yaml (runtime profiles, curated architecture
facts) and recipes/. In the source tree both are links to the top-level files, which stay the ones
people edit; wheels and sdists carry copies. Read them through `pipelines.config.registry`."""
