"""Adapters that run other libraries' models on linattn's ops (`linattn.integrations.transformers`: the linear
attention of transformers' Qwen3-Next). Nothing here is imported by `import linattn`; each adapter imports its
library when used."""
