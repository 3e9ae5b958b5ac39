//! Prefetching: batches prepared ahead of use by worker threads, delivered in job order.
//!
//! Job k goes to worker k mod n through a bounded queue, and the consumer reads result k from
//! worker k mod n's bounded queue, so the order (and therefore the run) is the same with any
//! number of workers; each queue holds at most `depth` items, so memory stays bounded. With 0
//! workers the work runs inline on the consumer's thread. Dropping the iterator stops the
//! threads (their sends fail), and a finite job stream ends the iterator after its last result.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

/// The ordered results of [`prefetch`].
pub struct Prefetched<T> {
    inline: Option<Box<dyn Iterator<Item = T>>>,
    results: Vec<Receiver<T>>,
    next: usize,
    threads: Vec<JoinHandle<()>>,
}

impl<T> Iterator for Prefetched<T> {
    type Item = T;
    fn next(&mut self) -> Option<T> {
        if let Some(inline) = self.inline.as_mut() {
            return inline.next();
        }
        let n = self.results.len();
        let item = self.results[self.next % n].recv().ok();
        self.next += 1;
        item
    }
}

impl<T> Drop for Prefetched<T> {
    fn drop(&mut self) {
        // Closing the result queues makes every worker's next send fail, and then the
        // dispatcher's; joining here means no thread outlives the iterator.
        self.results.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs `work` over `jobs` on `workers` threads (0 = inline), at most `depth` results ahead
/// per worker, yielding results in job order.
pub fn prefetch<J, T, I, F>(jobs: I, workers: usize, depth: usize, work: F) -> Prefetched<T>
where
    J: Send + 'static,
    T: Send + 'static,
    I: Iterator<Item = J> + Send + 'static,
    F: Fn(J) -> T + Send + Sync + 'static,
{
    if workers == 0 {
        return Prefetched {
            inline: Some(Box::new(jobs.map(work))),
            results: Vec::new(),
            next: 0,
            threads: Vec::new(),
        };
    }
    let depth = depth.max(1);
    let work = Arc::new(work);
    let mut job_txs = Vec::with_capacity(workers);
    let mut results = Vec::with_capacity(workers);
    let mut threads = Vec::with_capacity(workers + 1);
    for w in 0..workers {
        let (job_tx, job_rx) = sync_channel::<J>(depth);
        let (res_tx, res_rx) = sync_channel::<T>(depth);
        let work = work.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("llora-loader-{w}"))
                .spawn(move || {
                    for job in job_rx {
                        if res_tx.send(work(job)).is_err() {
                            return;
                        }
                    }
                })
                .expect("spawn a loader thread"),
        );
        job_txs.push(job_tx);
        results.push(res_rx);
    }
    threads.push(
        std::thread::Builder::new()
            .name("llora-loader-dispatch".into())
            .spawn(move || {
                for (k, job) in jobs.enumerate() {
                    if job_txs[k % job_txs.len()].send(job).is_err() {
                        return;
                    }
                }
            })
            .expect("spawn the loader dispatcher"),
    );
    Prefetched { inline: None, results, next: 0, threads }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any worker count and depth gives exactly the inline sequence.
        #[test]
        fn order_is_independent_of_workers(n in 0usize..200, workers in 0usize..6, depth in 1usize..4) {
            let got: Vec<u64> = prefetch(0..n as u64, workers, depth, |x| x * x + 1).collect();
            let want: Vec<u64> = (0..n as u64).map(|x| x * x + 1).collect();
            prop_assert_eq!(got, want);
        }
    }

    /// An endless job stream stops when the consumer drops the iterator.
    #[test]
    fn dropping_an_endless_stream_stops_the_threads() {
        let mut it = prefetch(0u64.., 3, 2, |x| x + 1);
        assert_eq!(it.next(), Some(1));
        assert_eq!(it.next(), Some(2));
        drop(it); // joins the threads: the test would hang if they did not stop
    }
}
