from tinympt.modeling import TinyMptConfig, TinyMptForCausalLM

__all__ = ["TinyMptConfig", "TinyMptForCausalLM"]
