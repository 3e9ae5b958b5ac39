//! FP8 scales under context parallelism: the amaxes a scale is chosen from, taken over the
//! whole sequence rather than this rank's chunk of it.
//!
//! One process quantises a tensor of the whole sequence; a context-parallel rank holds its
//! chunk, whose amax is at most the whole's. Two scales are chosen from an amax at the moment
//! of quantising: a role's first use (before its delayed history exists) and current scaling
//! (the stored activations, every step). Inside [`with_amax_group`] those amaxes are
//! max-reduced over the group first, so every rank quantises with the scale one process would
//! use, as Transformer Engine reduces amaxes over its `amax_reduction_group`. The delayed
//! amaxes of later steps are read at the step's end and max-reduced over all ranks there (the
//! trainer), so they need nothing here.
//!
//! Every rank must reach the same reductions in the same order: the two call sites do not
//! depend on a route's verdict (a rank whose first-use check failed takes another route), and
//! inside the group current scaling takes the LibTorch route, whose amax is a separate pass.
//! A route's first-use check reduces nothing (`routes::run_check`): on one rank alone, it
//! would wait for ranks that never come.

use std::cell::RefCell;
use std::sync::Arc;

use crate::context_parallel::ContextGroup;

thread_local! {
    /// The group the amaxes of the current scope are reduced over.
    static GROUP: RefCell<Option<Arc<dyn ContextGroup>>> = const { RefCell::new(None) };
}

/// Runs `f` with the first-use and current-scaling amaxes taken inside it max-reduced over
/// `group` (`None`: this rank's own, as outside any scope). The earlier setting is restored
/// after `f`, also when it unwinds; nothing is borrowed while `f` runs.
pub fn with_amax_group<T>(group: Option<Arc<dyn ContextGroup>>, f: impl FnOnce() -> T) -> T {
    crate::scoped::with_value(&GROUP, group, f)
}

/// Whether amaxes are reduced over a group here (then current scaling keeps to the routes
/// whose amax is a pass of its own).
pub fn active() -> bool {
    GROUP.with(|g| g.borrow().is_some())
}

/// `amax` (0-dim f32, this rank's) as the group's largest, NaN if any rank's is; `amax` itself
/// outside a group, or once the group has failed (the failure is recorded for the trainer, as
/// attention records its own).
///
/// # Shapes
/// - amax: `[]`; output: `[]`
pub fn reduced(amax: tch::Tensor) -> tch::Tensor {
    let Some(group) = GROUP.with(|g| g.borrow().clone()) else { return amax };
    if crate::context_parallel::failed() {
        return amax;
    }
    match group.all_gather(&amax.reshape([1])) {
        // torch's max propagates NaN: one rank's NaN amax is the group's.
        Ok(all) => all.max(),
        Err(e) => {
            crate::context_parallel::record_failure(format!("FP8 amax reduction: {e:#}"));
            amax
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group of one rank standing in for a sequence's N ranks: gathering gives its amax
    /// next to the others' (fixed), so the reduction's maximum and NaN are visible.
    struct Others(Vec<f32>);

    impl ContextGroup for Others {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            self.0.len() + 1
        }
        fn all_gather(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            let others = tch::Tensor::from_slice(&self.0).reshape([-1, 1]);
            Ok(tch::Tensor::cat(&[x.reshape([1, 1]), others], 0))
        }
        fn all_reduce_sum(&self, _: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            unreachable!("amaxes are max-reduced")
        }
    }

    /// Inside the scope the amax is the group's largest (a NaN anywhere is NaN); outside, and
    /// after a scope that unwound, this rank's own; scopes nest.
    #[test]
    fn amaxes_are_the_groups_inside_the_scope_only() {
        let mine = || tch::Tensor::from(2.5f32);
        let value = |t: tch::Tensor| t.double_value(&[]);
        assert_eq!(value(reduced(mine())), 2.5);
        with_amax_group(Some(Arc::new(Others(vec![7.0, 1.0]))), || {
            assert!(active());
            assert_eq!(value(reduced(mine())), 7.0);
            with_amax_group(None, || assert_eq!(value(reduced(mine())), 2.5));
            assert_eq!(value(reduced(mine())), 7.0);
        });
        let nan = Some(Arc::new(Others(vec![f32::NAN])) as Arc<dyn ContextGroup>);
        assert!(with_amax_group(nan, || value(reduced(mine()))).is_nan());
        let unwound = std::panic::catch_unwind(|| {
            with_amax_group(Some(Arc::new(Others(vec![9.0]))), || panic!("inside"));
        });
        assert!(unwound.is_err() && !active());
        assert_eq!(value(reduced(mine())), 2.5);
    }
}
