"""Training-side model: transformers' LlamaForCausalLM plus DeepSeek-V3-style MTP modules.

Depth m (1-based) at row i sees embed(t[i+m]) and the depth m-1 hidden at row i (depth 0 is
the main model's post-norm last hidden state) and predicts t[i+m+1].
"""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_layers import MtpLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm


class LlamaWithMtp(nn.Module):
    def __init__(self, config: LlamaConfig, num_mtp_modules: int):
        super().__init__()
        self.config = config
        self.llama = LlamaForCausalLM(config)
        self.mtp_modules = nn.ModuleList(
            MtpLayer(config, LlamaDecoderLayer, LlamaRMSNorm, layer_idx=j, use_post_norm=True)
            for j in range(num_mtp_modules)
        )
        # MtpLayer's fresh nn.Linear / decoder weights are not touched by the Llama init.
        self.mtp_modules.apply(self.llama._init_weights)

    def forward(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Logits per depth: [main (T rows), depth 1 (T-1 rows), depth 2 (T-2 rows), ...].

        Row i of depth m predicts token i+m+1; its last row has no target inside the window.
        """
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
        base = self.llama.model
        hidden = base(input_ids=input_ids, position_ids=position_ids).last_hidden_state  # post-norm
        logits_per_depth = [self.llama.lm_head(hidden)]
        cos, sin = base.rotary_emb(hidden, position_ids)
        for depth, mtp in enumerate(self.mtp_modules, start=1):
            rows = seq_len - depth
            hidden = mtp(
                inputs_embeds=base.embed_tokens(input_ids[:, depth:]),
                previous_hidden_state=hidden[:, :rows],
                position_embeddings=(cos[:, :rows], sin[:, :rows]),
                attention_mask=None,  # sdpa then runs with is_causal=True
                position_ids=position_ids[:, :rows],
                cache=None,
            )
            logits_per_depth.append(self.llama.lm_head(hidden))
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
    first_mtp_layer = model.config.num_hidden_layers
    for j, mtp in enumerate(model.mtp_modules):
        prefix = f"model.layers.{first_mtp_layer + j}."
        for name, tensor in mtp.state_dict().items():
            name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            state[prefix + name] = tensor
    return {k: v.detach().contiguous().clone() for k, v in state.items()}
