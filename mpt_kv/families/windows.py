"""The windows of a family's layers, read from its config (`Family.windows`)."""


def hybrid_windows(config) -> list:
    """transformers' `layer_types` ("sliding_attention" / "full_attention" per layer): the
    config's `sliding_window` on each sliding layer, None on a full one."""
    types = config.layer_types
    if types is None or len(types) != config.num_hidden_layers:
        raise ValueError(f"{config.model_type}: layer_types {types!r} does not name each of the "
                         f"{config.num_hidden_layers} layers")
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def every_layer_window(config) -> list:
    """`sliding_window` on every layer (mistral: no `layer_types`; transformers 5.x's cache makes
    each layer a sliding one when the config has a window, cache_utils.py's DynamicCache)."""
    if not config.sliding_window:
        raise ValueError(f"{config.model_type}: sliding_window {config.sliding_window!r}: every layer's window "
                         "needs one (an int >= 2)")
    return [config.sliding_window] * config.num_hidden_layers


def history_before_4_56(config) -> list | None:
    """What transformers before 4.56 caches of a model's local (sliding-window) layers: the whole
    history (4.55.4 generate makes a plain `DynamicCache()`, generation/utils.py:2087-2093, and its
    StaticCache preallocates every layer to the cache length); None (the windows) from 4.56.0 on
    (the repro sweep of the concat path, docs/releases.md: 4.56.0-4.57.6 and 5.x keep the window)."""
    from packaging.version import Version

    from mpt_kv.versions import transformers_version

    return [None] * config.num_hidden_layers if Version(transformers_version()) < Version("4.56.0") else None
