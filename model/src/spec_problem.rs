//! `SpecProblem`: one thing wrong with a spec a config section deserialises into
//! ([`crate::LoraSpec`], [`crate::precision::PrecisionSpec`]), named by its key so that the
//! config reports it as `lora.rank`, `precision.amax_margin`, or a command flag.

/// One thing wrong with a spec: its key, the value (debug-formatted) and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecProblem {
    /// `rank`, `targets`, `rank_pattern.<key>`, `precision.compute`, ...
    pub key: String,
    /// The value given.
    pub value: String,
    /// What it must be.
    pub allowed: String,
}

/// Collects [`SpecProblem`]s.
#[derive(Debug, Default)]
pub struct SpecProblems(pub Vec<SpecProblem>);

impl SpecProblems {
    /// Records that `key` = `value` is not `allowed`, unless `ok`.
    pub fn check(&mut self, ok: bool, key: &str, value: &dyn std::fmt::Debug, allowed: &str) {
        if !ok {
            self.0.push(SpecProblem { key: key.into(), value: format!("{value:?}"), allowed: allowed.into() });
        }
    }
}
