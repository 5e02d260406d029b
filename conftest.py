# The suite's pytest plugin (options --device, --require-device, --target, the report).
pytest_plugins = ["mpt_kv.plugin"]
