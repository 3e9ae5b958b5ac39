//! Llama-architecture causal LM with LoRA adapters for llora.
#![allow(deprecated)] // burn-tch is deprecated upstream but is the backend llora is built on.
pub mod attention;
pub mod checkpoint;
pub mod config;
pub mod context;
pub mod device;
pub mod dropout;
pub mod fp8;
pub mod generate;
pub mod kernels;
pub mod layout;
pub mod llama;
pub mod load;
pub mod lora;
pub mod lora_spec;
pub mod loss;
pub mod merge;
pub mod norm;
pub mod packing;
pub mod params;
pub mod patterns;
pub mod peft;
pub mod precision;
pub mod profile;
pub mod recompute;
pub mod rope;
pub mod route_list;
pub mod routes;
pub mod saved;
pub mod scoped;
pub mod shard;
pub mod spec_problem;

pub use config::LlamaConfig;
pub use llama::{BuildOptions, LlamaForCausalLM};
pub use lora::{LoraAdapter, LoraLinear, LoraSpec};
