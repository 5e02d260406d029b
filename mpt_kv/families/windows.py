"""The windows of a family's layers, read from its config (`Family.windows`)."""


def hybrid_windows(config) -> list:
    """transformers' `layer_types` ("sliding_attention" / "full_attention" per layer): the
    config's `sliding_window` on each sliding layer, None on a full one."""
    types = config.layer_types
    if types is None or len(types) != config.num_hidden_layers:
        raise ValueError(f"{config.model_type}: layer_types {types!r} does not name each of the "
                         f"{config.num_hidden_layers} layers")
    return [config.sliding_window if t == "sliding_attention" else None for t in types]
