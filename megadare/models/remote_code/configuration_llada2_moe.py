"""``LLaDA2MoeConfig``: the config.json class of LLaDA2 (``model_type: llada2_moe``) for transformers' AutoConfig.

No transformers release knows ``llada2_moe``; the publisher's checkpoints carry their own
``configuration_llada2_moe.py`` (with ``auto_map``), and megadare's exports copy it along. Checkpoints megadare
writes from scratch (tiny test / demo models) carry this file instead, so that ``AutoConfig.from_pretrained(dir,
trust_remote_code=True)`` -- what SGLang runs on every checkpoint it serves -- reads them. It stores config.json as
it is; the defaults are only for keys SGLang's LLaDA2 model reads without a fallback. Self-contained on purpose:
transformers copies it into its module cache and imports it there (megadare need not be installed).
"""

from transformers import PretrainedConfig


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"

    def __init__(
        self, use_bias=False, use_qkv_bias=False, use_qk_norm=True, embedding_dropout=0.0, hidden_act="silu", **kwargs
    ):
        self.use_bias = use_bias
        self.use_qkv_bias = use_qkv_bias
        self.use_qk_norm = use_qk_norm
        self.embedding_dropout = embedding_dropout
        self.hidden_act = hidden_act
        super().__init__(**kwargs)
