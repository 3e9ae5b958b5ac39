//! Walks over the model's parameters and linear layers, each named as HF / PEFT save it: what
//! checkpoints, the optimizer, gradient all-reduce and precision switches iterate over.

use burn::module::Param;
use burn::tensor::Tensor;

use crate::llama::{DecoderLayer, LlamaForCausalLM};
use crate::lora::{LoraAdapter, LoraLinear};

/// The name of DoRA's magnitude in a PEFT adapter file, after the module's
/// (`...q_proj.lora_magnitude_vector`, `[out]`).
pub const MAGNITUDE: &str = "lora_magnitude_vector";

impl LlamaForCausalLM {
    /// Every adapter with its PEFT module path, in forward order
    /// (`base_model.model.model.layers.0.self_attn.q_proj`, ...).
    pub fn adapters(&self) -> Vec<(String, &LoraAdapter)> {
        let mut out = Vec::new();
        for (name, layer) in self.named_linears() {
            if let Some(a) = &layer.lora {
                out.push((format!("base_model.model.{name}"), a));
            }
        }
        out
    }

    /// Mutable access to every adapter, in the order of [`LlamaForCausalLM::adapters`].
    pub fn adapters_mut(&mut self) -> Vec<(String, &mut LoraAdapter)> {
        let mut out = Vec::new();
        for (name, layer) in self.named_linears_mut() {
            if let Some(a) = layer.lora.as_mut() {
                out.push((format!("base_model.model.{name}"), a));
            }
        }
        out
    }

    /// Every linear layer with its HF module path (`model.layers.0.self_attn.q_proj`), in
    /// forward order.
    pub fn named_linears(&self) -> Vec<(String, &LoraLinear)> {
        let blocks = self.layers.iter().enumerate();
        blocks.flat_map(|(l, layer)| layer.linears().into_iter().map(move |(k, m)| (k.path(l), m))).collect()
    }

    /// Mutable variant of [`LlamaForCausalLM::named_linears`], same order.
    pub fn named_linears_mut(&mut self) -> Vec<(String, &mut LoraLinear)> {
        let blocks = self.layers.iter_mut().enumerate();
        blocks.flat_map(|(l, layer)| layer.linears_mut().into_iter().map(move |(k, m)| (k.path(l), m))).collect()
    }

    /// Every parameter of one kind, named as it is saved: base weights with HF names
    /// (`model.layers.0.mlp.up_proj.weight`), adapters with PEFT names
    /// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, DoRA's
    /// `...q_proj.lora_magnitude_vector`). In forward order.
    pub fn params_mut(&mut self, kind: ParamKind) -> Vec<(String, ParamMut<'_>)> {
        let mut out = Vec::new();
        match kind {
            ParamKind::Adapters => {
                for (name, a) in self.adapters_mut() {
                    out.push((format!("{name}.lora_A.weight"), ParamMut::Matrix(&mut a.a)));
                    out.push((format!("{name}.lora_B.weight"), ParamMut::Matrix(&mut a.b)));
                    if let Some(m) = a.magnitude.as_mut() {
                        out.push((format!("{name}.{}", MAGNITUDE), ParamMut::Vector(m)));
                    }
                }
            }
            ParamKind::Base => {
                out.push(("model.embed_tokens.weight".to_string(), ParamMut::Matrix(&mut self.embed_tokens)));
                for (l, layer) in self.layers.iter_mut().enumerate() {
                    let p = format!("model.layers.{l}");
                    let DecoderLayer { input_layernorm, self_attn, post_attention_layernorm, mlp } = layer;
                    out.push((format!("{p}.input_layernorm.weight"), ParamMut::Vector(&mut input_layernorm.weight)));
                    out.push((
                        format!("{p}.post_attention_layernorm.weight"),
                        ParamMut::Vector(&mut post_attention_layernorm.weight),
                    ));
                    let (attention, head_norms) = self_attn.parts_mut();
                    for (name, norm) in head_norms {
                        out.push((format!("{p}.self_attn.{name}.weight"), ParamMut::Vector(&mut norm.weight)));
                    }
                    // A stored frozen weight is no parameter: nothing trains or saves it as one.
                    for (kind, linear) in attention.into_iter().chain(mlp.linears_mut()) {
                        let LoraLinear { weight, bias, .. } = linear;
                        if let Some(weight) = weight.param_mut() {
                            out.push((format!("{}.weight", kind.path(l)), ParamMut::Matrix(weight)));
                        }
                        if let Some(bias) = bias.as_mut() {
                            out.push((format!("{}.bias", kind.path(l)), ParamMut::Vector(bias)));
                        }
                    }
                }
                out.push(("model.norm.weight".to_string(), ParamMut::Vector(&mut self.norm.weight)));
                if let Some(head) = self.lm_head.as_mut() {
                    out.push(("lm_head.weight".to_string(), ParamMut::Matrix(head)));
                }
            }
        }
        out
    }

    /// The parameters training updates: every base weight under full fine-tuning, else the
    /// adapters.
    pub fn trainable_params_mut(&mut self) -> Vec<(String, ParamMut<'_>)> {
        self.params_mut(if self.trains_base() { ParamKind::Base } else { ParamKind::Adapters })
    }

    /// A copy of every trainable parameter's value now, flattened, on the plain backend, in
    /// [`Self::trainable_params_mut`] order, sharing no storage with the model (the optimizer
    /// updates parameters in place): the frozen reference of preference tuning.
    pub fn frozen_trainable_values(&mut self) -> Vec<Tensor<1>> {
        self.trainable_params_mut()
            .into_iter()
            .map(|(_, p)| {
                let value = p.flat().inner();
                let device = value.device();
                Tensor::from_data(value.into_data(), &device)
            })
            .collect()
    }

    /// A copy of the model sharing every tensor, its trainable parameters holding `values`
    /// ([`Self::frozen_trainable_values`]) and requiring no gradient.
    pub(crate) fn with_frozen_values(&self, values: &[Tensor<1>]) -> anyhow::Result<Self> {
        let mut copy = self.clone();
        let params = copy.trainable_params_mut();
        anyhow::ensure!(
            params.len() == values.len(),
            "the frozen reference holds {} tensors, the model trains {}",
            values.len(),
            params.len()
        );
        for ((name, mut p), v) in params.into_iter().zip(values) {
            let (now, mut shape) = p.take_flat();
            anyhow::ensure!(
                now.dims() == v.dims(),
                "the frozen reference's {name} is {:?}, not {:?}",
                v.dims(),
                now.dims()
            );
            shape.trainable = false;
            p.put_flat(v.clone(), shape);
        }
        Ok(copy)
    }
}

/// Which parameters [`LlamaForCausalLM::params_mut`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Embeddings, norms, linear weights, LM head (HF names).
    Base,
    /// LoRA A and B, and DoRA's magnitude (PEFT names).
    Adapters,
}

/// What [`ParamMut::put_flat`] needs to put a taken value back.
#[derive(Debug, Clone, Copy)]
pub struct ParamShape {
    /// A matrix's `[rows, cols]`; `None` for a vector.
    dims: Option<[usize; 2]>,
    /// Whether the value requires a gradient.
    trainable: bool,
}

/// A parameter's value as [`ParamMut::grad_key`] keeps it, to look its gradient up by.
pub enum GradKey {
    /// A norm gain `[d]`.
    Vector(Tensor<1>),
    /// A weight matrix.
    Matrix(Tensor<2>),
}

impl GradKey {
    /// The parameter's gradient in `grads`, flattened; `None` where that backward did not reach it.
    pub fn grad_flat(&self, grads: &burn::tensor::Gradients) -> Option<Tensor<1>> {
        match self {
            Self::Vector(t) => t.grad(grads),
            Self::Matrix(t) => t.grad(grads).map(|g| g.flatten(0, 1)),
        }
    }
}

/// A mutable parameter of either rank the model has.
pub enum ParamMut<'a> {
    /// A norm gain `[d]`.
    Vector(&'a mut Param<Tensor<1>>),
    /// A weight matrix.
    Matrix(&'a mut Param<Tensor<2>>),
}

impl ParamMut<'_> {
    /// The value flattened to one dimension (same autodiff node: gradients can be looked up).
    pub fn flat(&self) -> Tensor<1> {
        match self {
            Self::Vector(p) => p.val(),
            Self::Matrix(p) => p.val().flatten(0, 1),
        }
    }

    /// The value's dtype and device.
    pub fn dtype_and_device(&self) -> (burn::tensor::DType, burn::tensor::Device) {
        match self {
            Self::Vector(p) => (p.dtype(), p.device()),
            Self::Matrix(p) => (p.dtype(), p.device()),
        }
    }

    /// The gradient of this parameter in `grads`, flattened.
    pub fn grad_flat(&self, grads: &burn::tensor::Gradients) -> Option<Tensor<1>> {
        match self {
            Self::Vector(p) => p.val().grad(grads),
            Self::Matrix(p) => p.val().grad(grads).map(|g| g.flatten(0, 1)),
        }
    }

    /// What finds this parameter's gradient in a backward's gradients while the parameter
    /// itself is not borrowed (a clone of its value: the same autodiff node).
    pub fn grad_key(&self) -> GradKey {
        match self {
            Self::Vector(p) => GradKey::Vector(p.val()),
            Self::Matrix(p) => GradKey::Matrix(p.val()),
        }
    }

    /// What [`ParamMut::put_flat`] needs to put a flattened value back: the shape and whether
    /// the value requires a gradient.
    fn shape(&self) -> ParamShape {
        match self {
            Self::Vector(p) => ParamShape { dims: None, trainable: p.val().is_require_grad() },
            Self::Matrix(p) => ParamShape { dims: Some(p.shape().dims()), trainable: p.val().is_require_grad() },
        }
    }

    /// Takes the value out, flattened, on the plain backend, leaving an empty placeholder until
    /// [`ParamMut::put_flat`]: the caller then holds the only handle Burn keeps to it (unless
    /// something else cloned the value), so an in-place update is seen by nobody else.
    pub fn take_flat(&mut self) -> (Tensor<1>, ParamShape) {
        let shape = self.shape();
        let value = match self {
            Self::Vector(p) => {
                let empty = Param::initialized(p.id, Tensor::empty([0], &p.device()));
                std::mem::replace(&mut **p, empty).into_value().inner()
            }
            Self::Matrix(p) => {
                let empty = Param::initialized(p.id, Tensor::empty([0, 0], &p.device()));
                std::mem::replace(&mut **p, empty).into_value().inner().flatten(0, 1)
            }
        };
        (value, shape)
    }

    /// Puts a value taken by [`ParamMut::take_flat`] back as `new` (flattened, plain backend,
    /// the taken value's length), with the taken value's shape, id and trainability.
    pub fn put_flat(&mut self, new: Tensor<1>, shape: ParamShape) {
        match (self, shape.dims) {
            (Self::Vector(p), None) => {
                **p = Param::initialized(p.id, Tensor::from_inner(new).set_require_grad(shape.trainable));
            }
            (Self::Matrix(p), Some(dims)) => {
                let t = Tensor::from_inner(new.reshape(dims)).set_require_grad(shape.trainable);
                **p = Param::initialized(p.id, t);
            }
            _ => panic!("put_flat: a shape taken from a parameter of the other rank"),
        }
    }

    /// Replaces the value with `new` (flattened, plain backend), keeping the id and trainability.
    pub fn set_flat(&mut self, new: Tensor<1>) {
        let shape = self.shape();
        self.put_flat(new, shape);
    }
}
