"""glmc: a declarative graph compiler and runtime for GLM-5.x (glm_moe_dsa)."""
__version__ = "0.1.0"
