//! Per-module adapter settings as PEFT matches them: `rank_pattern` / `alpha_pattern` keys and
//! `layers_to_transform`.
//!
//! A pattern key is a regular expression that must match the end of a module's full name
//! (`model.layers.3.self_attn.q_proj`) from a `.` boundary or from its start: PEFT's
//! `get_pattern_key` tries `re.match(rf"(.*\.)?({key})$", name)` for each key in file order and
//! takes the first that matches. File order does not survive every JSON/TOML reader, so where
//! two keys with different values match one module llora refuses, naming both, rather than
//! pick one.

use std::fmt::Debug;

/// A compiled pattern key.
fn key_regex(key: &str) -> Result<regex::Regex, String> {
    regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).map_err(|e| {
        format!("{key:?} is not a regular expression llora can read (no look-around or back-references): {e}")
    })
}

/// Checks that every key of `pattern` compiles; the error names the first that does not.
pub fn check_keys<T>(pattern: &[(String, T)]) -> Result<(), String> {
    pattern.iter().try_for_each(|(k, _)| key_regex(k).map(|_| ()))
}

/// The value `pattern` gives module `name`, `None` when no key matches; an error when keys that
/// match give different values (or a key does not compile).
pub fn value_for<T: Copy + PartialEq + Debug>(pattern: &[(String, T)], name: &str) -> Result<Option<T>, String> {
    let mut found: Option<(&str, T)> = None;
    for (key, value) in pattern {
        if !key_regex(key)?.is_match(name) {
            continue;
        }
        match found {
            Some((other, v)) if v != *value => {
                return Err(format!("keys {other:?} ({v:?}) and {key:?} ({value:?}) both match {name}"));
            }
            Some(_) => {}
            None => found = Some((key, *value)),
        }
    }
    Ok(found.map(|(_, v)| v))
}

/// The decoder layer of a module name (`model.layers.3.mlp.up_proj` → 3), as PEFT finds it
/// for `layers_to_transform`: the first number between dots after a `layers` segment.
pub fn layer_index(name: &str) -> Option<usize> {
    let mut parts = name.split('.');
    parts.by_ref().find(|p| *p == "layers")?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked out by hand from PEFT's `get_pattern_key` rule `(.*\.)?({key})$`.
    #[test]
    fn keys_match_as_peft_matches_them() {
        let p = |keys: &[(&str, usize)]| keys.iter().map(|(k, v)| (k.to_string(), *v)).collect::<Vec<_>>();
        let q0 = "model.layers.0.self_attn.q_proj";
        assert_eq!(value_for(&p(&[("q_proj", 4)]), q0), Ok(Some(4)));
        // The key must end the name and start at a dot: "proj" and "_proj" do not match.
        assert_eq!(value_for(&p(&[("proj", 4), ("_proj", 2)]), q0), Ok(None));
        assert_eq!(value_for(&p(&[("layers.0.self_attn.q_proj", 4)]), q0), Ok(Some(4)));
        assert_eq!(value_for(&p(&[("layers.1.self_attn.q_proj", 4)]), q0), Ok(None));
        assert_eq!(value_for(&p(&[(r"layers\.[0-2]\..*", 8)]), q0), Ok(Some(8)));
        assert_eq!(value_for(&p(&[("q_proj", 4), ("self_attn.q_proj", 4)]), q0), Ok(Some(4)));
        let e = value_for(&p(&[("q_proj", 4), (r".*\.0\..*", 8)]), q0).unwrap_err();
        assert!(e.contains("\"q_proj\"") && e.contains("both match"), "{e}");
        assert!(check_keys(&p(&[("(q", 1)])).unwrap_err().contains("(q"));
        assert_eq!(layer_index(q0), Some(0));
        assert_eq!(layer_index("model.layers.17.mlp.down_proj"), Some(17));
        assert_eq!(layer_index("lm_head"), None);
    }
}
