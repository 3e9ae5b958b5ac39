//! llora against the reference libraries run in the peer venv (`scripts/peer/`): HF transformers
//! and PEFT, bitsandbytes, TRL. Fixtures are made by the peer's scripts and cached under a hash
//! of what made them (`tests/common/peer.rs`).

mod export;
mod families;
mod generate;
mod llama;
mod nf4;
mod packing;
