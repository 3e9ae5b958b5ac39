//! Activation recomputation: a training micro-batch's gradients block by block, with the first
//! blocks' activations recomputed in backward instead of kept, and each sharded block's weights
//! gathered for its forward and again for its backward.

use burn::module::Module;
use burn::tensor::{Int, Tensor};

use std::sync::Arc;

use crate::dropout::BlockSeeds;
use crate::llama::{LlamaForCausalLM, embed};
use crate::packing::PackedRows;

/// How [`LlamaForCausalLM::recomputed_backward`] cuts the backward into segments, and who sees
/// each segment's gradients as it is done.
pub struct Segments<'a> {
    /// Every block a segment of its own, recomputed or not.
    pub every_block: bool,
    /// Called with each segment's gradients, in the order their backward is queued.
    pub done: Option<&'a mut dyn FnMut(&burn::tensor::Gradients)>,
}

impl Segments<'_> {
    /// Blocks grouped only as recomputation and sharding need, nobody told.
    pub fn plain() -> Segments<'static> {
        Segments { every_block: false, done: None }
    }

    /// Hands a segment's gradients to whoever listens.
    fn tell(&mut self, grads: &burn::tensor::Gradients) {
        if let Some(done) = self.done.as_mut() {
            done(grads);
        }
    }
}

impl LlamaForCausalLM {
    /// Gradients of `loss_sum / norm` of a training micro-batch, computed block by block, with
    /// the first `recompute` decoder blocks recomputed: a forward without autodiff keeps only
    /// each of those blocks' input; the rest of the model runs with autodiff and backpropagates
    /// to the input of block `recompute`; then each recomputed block, last first, runs its
    /// forward again from its saved input and backpropagates the gradient it receives (as the
    /// gradient of `sum(y · g)`). Dropout masks are drawn from a seed per block and FP8 scales
    /// change only between steps, so the second forward is the first one: results equal the
    /// plain backward's.
    ///
    /// A sharded model runs every block as its own segment (the others keep their autodiff
    /// graph from the forward): each block's weights are gathered for its forward and again
    /// for its backward, and freed after each. Returns the loss (`[1]`, on the device, not read
    /// back: no host-device synchronisation here) and one `Gradients` per
    /// segment; every trainable parameter's gradient is in exactly one of them, except a tied
    /// embedding's under full fine-tuning: its head part and its embedding part, to be summed.
    /// `forward_done` is called once the loss is queued, before any backward: the caller's
    /// phase clock (the recomputed blocks' second forward counts as backward, as in PyTorch's
    /// checkpointing). With `cuts.every_block` every block is a segment of its own (as
    /// when sharded), and `cuts.done` sees each segment's gradients as soon as its backward
    /// is queued, the head's first, then the blocks' last first: a data-parallel run starts
    /// reducing them while the blocks below run their backward.
    ///
    /// # Shapes
    /// - input_ids, labels: `[batch, seq]`
    pub fn recomputed_backward(
        &self,
        input_ids: Tensor<2, Int>,
        labels: impl Into<crate::loss::Labels>,
        packed: Option<&Arc<PackedRows>>,
        (norm, recompute): (f64, usize),
        forward_done: impl FnOnce(),
        mut cuts: Segments<'_>,
    ) -> anyhow::Result<(Tensor<1>, Vec<burn::tensor::Gradients>)> {
        /// What the backward of one block starts from.
        enum Segment {
            /// The block's input, to run its forward again.
            Recompute(Tensor<3>),
            /// The block's input (a graph leaf) and output, with the graph between them.
            Graph(Tensor<3>, Tensor<3>),
        }
        let n = recompute.min(self.layers.len());
        // Blocks [0, n) are recomputed, [n, split) keep their own graphs, [split, L) share the
        // head's graph.
        let split = if self.is_sharded() || cuts.every_block { self.layers.len() } else { n };
        let mut out = Vec::new();
        let mut done = |grads: burn::tensor::Gradients| {
            cuts.tell(&grads);
            out.push(grads);
        };
        let device = input_ids.device();
        let at = self.positions(input_ids.dims(), packed, &device)?;
        let blocks = BlockSeeds::draw(&device, true);
        let inner = self.valid();
        let at_inner = at.inner();
        let mut x = embed(inner.embed_tokens.val(), at.local_ids(input_ids.clone()).inner(), self.activations);
        let mut segments = Vec::with_capacity(split);
        for k in 0..split {
            blocks.seed(&device, k);
            self.layers[k].gather(k)?;
            if k + 1 < split {
                self.prefetch(k + 1)?;
            }
            if k < n {
                segments.push(Segment::Recompute(x.clone()));
                x = inner.layers[k].forward(x, &at_inner, true);
            } else {
                let input = Tensor::from_inner(x).require_grad();
                let y = self.layers[k].forward(input.clone(), &at, true);
                x = y.clone().inner();
                segments.push(Segment::Graph(input, y));
            }
            self.layers[k].release();
        }
        drop(inner);
        let top_in = Tensor::from_inner(x).require_grad();
        let mut h = top_in.clone();
        for (k, layer) in self.layers.iter().enumerate().skip(split) {
            blocks.seed(&device, k);
            h = layer.forward(h, &at, true);
        }
        let packed = packed.map(|p| &**p);
        let split = at.context.as_ref().map(|cp| cp.split);
        let loss = crate::loss::target_rows_loss(self.norm.forward(h), self.head(), labels, packed, split.as_ref())
            .loss_sum
            .sum()
            .div_scalar(norm);
        // Kept on the device: the caller reads it with the step's other values, in one sync.
        let value = loss.clone().inner();
        forward_done();
        let grads = loss.backward();
        let mut g = top_in.grad(&grads);
        done(grads);
        // Each block below the head's graph, last first.
        for (k, segment) in segments.into_iter().enumerate().rev() {
            let Some(upstream) = g.take() else {
                self.layers[k].release(); // prefetched, not needed
                break;
            };
            let layer = &self.layers[k];
            layer.gather(k)?;
            if k > 0 {
                self.prefetch(k - 1)?;
            }
            let (input, y) = match segment {
                Segment::Recompute(x) => {
                    let input = Tensor::from_inner(x).require_grad();
                    blocks.seed(&device, k);
                    (input.clone(), layer.forward(input, &at, true))
                }
                Segment::Graph(input, y) => (input, y),
            };
            let grads = (y * Tensor::from_inner(upstream)).sum().backward();
            layer.release();
            g = input.grad(&grads);
            done(grads);
        }
        // A trainable embedding (full fine-tuning) takes the gradient of block 0's input.
        if let Some(upstream) = g.filter(|_| self.embed_tokens.val().is_require_grad()) {
            let emb = embed(self.embed_tokens.val(), input_ids, self.activations);
            done((emb * Tensor::from_inner(upstream)).sum().backward());
        }
        Ok((value, out))
    }
}
