from ownmpt.modeling import ConcatCache, OwnMptConfig, OwnMptForCausalLM, StaticCache

__all__ = ["ConcatCache", "OwnMptConfig", "OwnMptForCausalLM", "StaticCache"]
