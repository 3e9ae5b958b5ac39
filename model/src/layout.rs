//! A decoder block's linear layers, described once: each one's HF name, place in the block,
//! shape and input. Loading, the parameter walks (checkpoints, optimizer, FP8 state, sharding),
//! PEFT's module names, merging a fused projection and the planner's counts all read this
//! table; adding a linear to the block is a row here and a field beside its forward
//! ([`crate::llama::Attention`], [`crate::llama::Mlp`]).

use crate::config::LlamaConfig;

/// The activation a block linear reads. Linears that read the same one share it: the
/// planner counts a saved input once per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearInput {
    /// The normed hidden state before attention, `[.., d]`.
    AttnIn,
    /// Attention's output, `[.., H·hd]`.
    AttnOut,
    /// The normed hidden state before the MLP, `[.., d]`.
    MlpIn,
    /// SwiGLU's output, `[.., I]`.
    MlpHidden,
}

impl LinearInput {
    /// The planner's name of this input (`attn_in`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::AttnIn => "attn_in",
            Self::AttnOut => "attn_out",
            Self::MlpIn => "mlp_in",
            Self::MlpHidden => "mlp_hidden",
        }
    }
}

/// One linear layer of a decoder block. A checkpoint has either `Qkv` (MLPerf's fused
/// checkpoint) or `Q`, `K` and `V` (the usual HF layout); the rest always.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockLinear {
    /// Query projection `[H·hd, d]`.
    Q,
    /// Key projection `[KV·hd, d]`.
    K,
    /// Value projection `[KV·hd, d]`.
    V,
    /// Fused projection `[(H + 2·KV)·hd, d]`, rows q then k then v.
    Qkv,
    /// Output projection `[d, H·hd]`.
    O,
    /// SwiGLU gate `[I, d]`.
    Gate,
    /// SwiGLU up `[I, d]`.
    Up,
    /// Down projection `[d, I]`.
    Down,
}

use BlockLinear::*;

impl BlockLinear {
    /// Every kind, in forward order.
    pub const ALL: [Self; 8] = [Q, K, V, Qkv, O, Gate, Up, Down];

    /// Every kind's module name, in forward order (what `lora.targets` may name).
    pub const NAMES: [&'static str; 8] =
        [Q.name(), K.name(), V.name(), Qkv.name(), O.name(), Gate.name(), Up.name(), Down.name()];

    /// The linears of a block of this layout, in forward order.
    pub fn of(fused_qkv: bool) -> &'static [Self] {
        if fused_qkv { &[Qkv, O, Gate, Up, Down] } else { &[Q, K, V, O, Gate, Up, Down] }
    }

    /// The module's own name, as a LoRA target names it (`q_proj`).
    pub const fn name(self) -> &'static str {
        match self {
            Q => "q_proj",
            K => "k_proj",
            V => "v_proj",
            Qkv => "qkv_proj",
            O => "o_proj",
            Gate => "gate_proj",
            Up => "up_proj",
            Down => "down_proj",
        }
    }

    /// The kind a module name (`q_proj`) or path (`model.layers.0.self_attn.q_proj`) ends in.
    pub fn from_name(name: &str) -> Option<Self> {
        let last = name.rsplit('.').next()?;
        Self::ALL.into_iter().find(|k| k.name() == last)
    }

    /// The block part that holds it (`self_attn`, `mlp`).
    pub fn part(self) -> &'static str {
        match self {
            Q | K | V | Qkv | O => "self_attn",
            Gate | Up | Down => "mlp",
        }
    }

    /// Its HF module path in decoder layer `layer` (`model.layers.0.self_attn.q_proj`).
    pub fn path(self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.{}", self.part(), self.name())
    }

    /// Whether a model of `family` gives it a bias (fused q/k/v: Llama's, none).
    pub fn has_bias(self, family: &crate::family::Family) -> bool {
        match self {
            Q | K | V => family.qkv_bias,
            O => family.o_bias,
            Qkv | Gate | Up | Down => false,
        }
    }

    /// The activation it reads.
    pub fn input(self) -> LinearInput {
        match self {
            Q | K | V | Qkv => LinearInput::AttnIn,
            O => LinearInput::AttnOut,
            Gate | Up => LinearInput::MlpIn,
            Down => LinearInput::MlpHidden,
        }
    }

    /// Its weight's shape `[out, in]` in a model of `c`.
    pub fn shape(self, c: &LlamaConfig) -> [usize; 2] {
        let (d, i) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        match self {
            Q => [qd, d],
            K | V => [kvd, d],
            Qkv => [qd + 2 * kvd, d],
            O => [d, qd],
            Gate | Up => [i, d],
            Down => [d, i],
        }
    }

    /// The separate projections whose rows it stacks (q, k, v for `Qkv`), else itself.
    pub fn parts(self) -> &'static [Self] {
        match self {
            Qkv => &[Q, K, V],
            Q => &[Q],
            K => &[K],
            V => &[V],
            O => &[O],
            Gate => &[Gate],
            Up => &[Up],
            Down => &[Down],
        }
    }

    /// Whether it projects the queries, keys or values (separately or fused).
    pub fn is_qkv(self) -> bool {
        self.input() == LinearInput::AttnIn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table against HF's `LlamaDecoderLayer` (transformers' modeling_llama): module paths,
    /// weight shapes `[out_features, in_features]` of Llama 2 70B written out by hand.
    #[test]
    fn the_table_matches_hf_llama_70b() {
        let c = LlamaConfig::preset("llama2-70b").unwrap();
        let got: Vec<(String, [usize; 2])> = BlockLinear::of(false).iter().map(|k| (k.path(3), k.shape(&c))).collect();
        let want = [
            ("model.layers.3.self_attn.q_proj", [8192, 8192]),
            ("model.layers.3.self_attn.k_proj", [1024, 8192]),
            ("model.layers.3.self_attn.v_proj", [1024, 8192]),
            ("model.layers.3.self_attn.o_proj", [8192, 8192]),
            ("model.layers.3.mlp.gate_proj", [28672, 8192]),
            ("model.layers.3.mlp.up_proj", [28672, 8192]),
            ("model.layers.3.mlp.down_proj", [8192, 28672]),
        ];
        assert_eq!(got, want.map(|(n, s)| (n.to_string(), s)));
        assert_eq!(Qkv.shape(&c), [10240, 8192]);
        let stacked: usize = Qkv.parts().iter().map(|p| p.shape(&c)[0]).sum();
        assert_eq!(stacked, Qkv.shape(&c)[0]);
        assert_eq!(BlockLinear::from_name("model.layers.0.mlp.down_proj"), Some(Down));
        assert_eq!(BlockLinear::from_name("lm_head"), None);
    }
}
