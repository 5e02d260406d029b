from owngqa.modeling import OwnGqaConfig, OwnGqaForCausalLM, RingCache, WindowCache

__all__ = ["OwnGqaConfig", "OwnGqaForCausalLM", "RingCache", "WindowCache"]
