"""Training-side model: transformers' LlamaForCausalLM plus DeepSeek-V3-style MTP modules.

Depth m (1-based) at row i sees embed(t[i+m]) and the depth m-1 hidden at row i (depth 0 is
the main model's post-norm last hidden state) and predicts t[i+m+1].
"""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig
from transformers.modeling_layers import MtpLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

DECODER_CLASSES = {
    "llama": (LlamaDecoderLayer, LlamaRMSNorm),
    "qwen2": (Qwen2DecoderLayer, Qwen2RMSNorm),
    "qwen3": (Qwen3DecoderLayer, Qwen3RMSNorm),
}


def mtp_layers(config: PretrainedConfig, num_modules: int) -> nn.ModuleList:
    """DeepSeek-V3-style modules whose block is the base architecture's decoder layer."""
    layer_class, norm_class = DECODER_CLASSES[config.model_type]
    return nn.ModuleList(
        MtpLayer(config, layer_class, norm_class, layer_idx=j, use_post_norm=True) for j in range(num_modules)
    )


def mtp_chain(mtp_modules: nn.ModuleList, embed_tokens: nn.Embedding, rotary_emb: nn.Module,
              input_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Hidden states per MTP depth [depth 1 (T-1 rows), depth 2 (T-2 rows), ...] from the main model's post-norm
    hidden states [B, T, H]; row i of depth m predicts token i+m+1."""
    seq_len = input_ids.shape[1]
    position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    cos, sin = rotary_emb(hidden, position_ids)
    out = []
    for depth, mtp in enumerate(mtp_modules, start=1):
        rows = seq_len - depth
        hidden = mtp(
            inputs_embeds=embed_tokens(input_ids[:, depth:]),
            previous_hidden_state=hidden[:, :rows],
            position_embeddings=(cos[:, :rows], sin[:, :rows]),
            attention_mask=None,  # sdpa then runs with is_causal=True
            position_ids=position_ids[:, :rows],
            cache=None,
        )
        out.append(hidden)
    return out


class LlamaWithMtp(nn.Module):
    def __init__(self, config: LlamaConfig, num_mtp_modules: int):
        super().__init__()
        self.config = config
        self.llama = LlamaForCausalLM(config)
        self.mtp_modules = mtp_layers(config, num_mtp_modules)
        # MtpLayer's fresh nn.Linear / decoder weights are not touched by the Llama init.
        self.mtp_modules.apply(self.llama._init_weights)

    def forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Logits per depth: [main (T rows), depth 1 (T-1 rows), depth 2 (T-2 rows), ...].

        Row i of depth m predicts token i+m+1; its last row has no target inside the window.
        """
        base = self.llama.model
        hidden = base(input_ids=input_ids).last_hidden_state  # post-norm
        depths = mtp_chain(self.mtp_modules, base.embed_tokens, base.rotary_emb, input_ids, hidden)
        logits_per_depth = [self.llama.lm_head(h) for h in [hidden, *depths]]
        return logits_per_depth


def build_llama_config(model_hyperparameters: dict, vocab_size: int, eos_token_id: int) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **{k: v for k, v in model_hyperparameters.items() if k != "num_nextn_predict_layers"},
    )
    config.num_nextn_predict_layers = model_hyperparameters["num_nextn_predict_layers"]
    config.architectures = ["LlamaForCausalLM"]
    return config


def export_state_dict(model: LlamaWithMtp) -> dict[str, torch.Tensor]:
    """Main weights as LlamaForCausalLM.save_pretrained names them, MTP module j as DeepSeek-V3 does:
    `model.layers.{num_hidden_layers + j}.{enorm,hnorm,eh_proj,shared_head.norm,<decoder block>}`."""
    state = {k: v for k, v in model.llama.state_dict().items() if k != "lm_head.weight"}
    state.update(export_mtp_state_dict(model.mtp_modules, model.config.num_hidden_layers))
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def export_mtp_state_dict(mtp_modules: nn.ModuleList, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    state = {}
    for j, mtp in enumerate(mtp_modules):
        prefix = f"model.layers.{num_hidden_layers + j}."
        for name, tensor in mtp.state_dict().items():
            name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            state[prefix + name] = tensor.detach().contiguous().clone()
    return state
