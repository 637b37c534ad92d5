//! Which replica of a stripe a read goes to (RackOut's read balancing), from what this mount
//! observes of each node: operations outstanding, recent latency, recent failures.
//!
//! Writes go to every replica; only reads choose. The static policy reads a stripe always from
//! the same replica (a hash of file and stripe), which spreads a uniform load evenly and keeps
//! nothing to measure. The adaptive policy reads from the replica whose node costs least now:
//! `(outstanding + 1) * recent latency`, so a node that is slow or loaded (by this mount or,
//! through its latency, by others) gets fewer reads. Either way a node that failed recently is
//! passed over while another replica is left: for 2 s, doubled with each failure in a row up to
//! 32 s, until an operation on it succeeds.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rackfs_proto::namespace::StripeExtent;
use rustc_hash::FxHashMap;

use crate::clock::SharedClock;
use crate::options::ReadPolicy;

/// How long a node that failed an operation is passed over by reads (ns), doubled with every
/// failure in a row up to [`MAX_FAILED_FOR_NS`], reset by a success.
const FAILED_FOR_NS: u64 = 2_000_000_000;
const MAX_FAILED_FOR_NS: u64 = 32_000_000_000;
/// Weight of the newest sample in the latency average, as a shift (1/8).
const EWMA_SHIFT: u32 = 3;

/// What this mount observes of one node.
#[derive(Default)]
pub struct Load {
    outstanding: AtomicU64,
    /// Recent batch latency, ns (exponentially weighted; 0 before the first sample).
    latency_ns: AtomicU64,
    /// When it last failed ([`crate::clock::Clock::mono_ns`]; 0: never).
    failed_at: AtomicU64,
    /// Failures since its last success.
    failures: AtomicU64,
}

impl Load {
    fn cost(&self) -> u128 {
        let lat = self.latency_ns.load(Ordering::Relaxed).max(1) as u128;
        (self.outstanding.load(Ordering::Relaxed) as u128 + 1) * lat
    }

    fn failed_recently(&self, now: u64) -> bool {
        let f = self.failed_at.load(Ordering::Relaxed);
        let n = self.failures.load(Ordering::Relaxed).clamp(1, 5) as u32;
        let passed_over = (FAILED_FOR_NS << (n - 1)).min(MAX_FAILED_FOR_NS);
        f != 0 && now.saturating_sub(f) < passed_over
    }
}

/// One batch in flight to a node: counted outstanding until dropped, then its latency is
/// sampled (only if it succeeded: a failure is noted by [`NodeLoads::failed`]).
pub struct InFlight {
    load: Arc<Load>,
    clock: SharedClock,
    started: u64,
    /// The batch's latency, once it completed.
    took: Option<u64>,
}

impl InFlight {
    /// The batch completed; returns how long it took (posted to completed).
    pub fn done(mut self) -> Duration {
        let took = self.clock.mono_ns().saturating_sub(self.started);
        self.took = Some(took);
        Duration::from_nanos(took)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.load.outstanding.fetch_sub(1, Ordering::Relaxed);
        if let Some(sample) = self.took {
            self.load.failures.store(0, Ordering::Relaxed);
            let old = self.load.latency_ns.load(Ordering::Relaxed);
            let new = if old == 0 {
                sample
            } else {
                old - (old >> EWMA_SHIFT) + (sample >> EWMA_SHIFT)
            };
            self.load.latency_ns.store(new, Ordering::Relaxed);
        }
    }
}

/// The mount's observations of every node, and the read policy that uses them.
pub struct NodeLoads {
    policy: RwLock<ReadPolicy>,
    nodes: RwLock<FxHashMap<u32, Arc<Load>>>,
    /// Times latencies and how long a failed node is passed over.
    clock: SharedClock,
}

impl NodeLoads {
    pub fn new(policy: ReadPolicy, clock: SharedClock) -> NodeLoads {
        NodeLoads {
            policy: RwLock::new(policy),
            nodes: RwLock::default(),
            clock,
        }
    }

    pub fn set_policy(&self, p: ReadPolicy) {
        *self.policy.write().expect("policy lock") = p;
    }

    fn load(&self, node: u32) -> Arc<Load> {
        if let Some(l) = self.nodes.read().expect("loads lock").get(&node) {
            return l.clone();
        }
        self.nodes
            .write()
            .expect("loads lock")
            .entry(node)
            .or_default()
            .clone()
    }

    /// A batch to `node` is about to go out.
    pub fn start(&self, node: u32) -> InFlight {
        let load = self.load(node);
        load.outstanding.fetch_add(1, Ordering::Relaxed);
        InFlight {
            load,
            clock: self.clock.clone(),
            started: self.clock.mono_ns(),
            took: None,
        }
    }

    /// An operation on `node` failed: reads pass it over for a while.
    pub fn failed(&self, node: u32) {
        let l = self.load(node);
        l.failed_at.store(self.clock.mono_ns(), Ordering::Relaxed);
        l.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The replica of stripe `stripe` of file `ino` a read should go to, among `replicas`
    /// leaving out nodes in `avoid`; `None` when every replica is avoided. Nodes in `held`
    /// (where the mount's QoS would make the read wait) are passed over while another
    /// replica's node is not.
    pub fn choose(
        &self,
        ino: u64,
        stripe: u64,
        replicas: &[StripeExtent],
        avoid: &[u32],
        held: &[u32],
    ) -> Option<StripeExtent> {
        // One copy (replicas=1, or a degraded stripe): nothing to choose, nothing to look up.
        if let [only] = replicas {
            return (!avoid.contains(&only.node)).then_some(*only);
        }
        // Filters over `replicas` in place (a read's hot path allocates nothing here): open
        // (not avoided), healthy (not failed recently) if any is, then not held if any is not.
        let now = self.clock.mono_ns();
        let nodes = self.nodes.read().expect("loads lock");
        let unseen = Load::default();
        let load = |e: &StripeExtent| nodes.get(&e.node).map_or(&unseen, |l| &**l);
        let open = |e: &StripeExtent| !avoid.contains(&e.node);
        let healthy = |e: &StripeExtent| open(e) && !load(e).failed_recently(now);
        let any_healthy = replicas.iter().any(healthy);
        let first = |e: &StripeExtent| if any_healthy { healthy(e) } else { open(e) };
        let any_free = replicas.iter().any(|e| first(e) && !held.contains(&e.node));
        let pooled = |e: &&StripeExtent| first(e) && !(any_free && held.contains(&e.node));
        let n = replicas.iter().filter(pooled).count();
        if n <= 1 {
            return replicas.iter().find(pooled).copied();
        }
        let fixed = *replicas
            .iter()
            .filter(pooled)
            .nth(static_index(ino, stripe, n))
            .expect("an index below the pool's size");
        match *self.policy.read().expect("policy lock") {
            ReadPolicy::Static => Some(fixed),
            ReadPolicy::Adaptive => {
                let best = replicas
                    .iter()
                    .filter(pooled)
                    .min_by_key(|e| load(e).cost())
                    .expect("two or more");
                // Ties go to the static choice, so an idle cluster still spreads reads.
                Some(if load(best).cost() < load(&fixed).cost() {
                    *best
                } else {
                    fixed
                })
            }
        }
    }
}

/// A well-mixed hash of file and stripe, modulo `n`.
fn static_index(ino: u64, stripe: u64, n: usize) -> usize {
    let mut x = ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stripe;
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    (x % n as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use std::time::Duration;

    fn ext(node: u32) -> StripeExtent {
        StripeExtent {
            node,
            offset: 64,
            tag: 1 << 40,
        }
    }

    fn loads(policy: ReadPolicy) -> (NodeLoads, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        (NodeLoads::new(policy, clock.clone()), clock)
    }

    #[test]
    fn static_reads_spread_over_replicas_and_stick_to_one_per_stripe() {
        let (l, _) = loads(ReadPolicy::Static);
        let r = [ext(0), ext(1)];
        let mut per_node = [0; 2];
        for stripe in 0..1000 {
            let a = l.choose(7, stripe, &r, &[], &[]).unwrap();
            assert_eq!(a, l.choose(7, stripe, &r, &[], &[]).unwrap());
            per_node[a.node as usize] += 1;
        }
        assert!(per_node.iter().all(|&n| n > 400), "{per_node:?}");
    }

    #[test]
    fn adaptive_reads_avoid_a_busy_node_and_everyone_avoids_a_failed_one() {
        let (l, _) = loads(ReadPolicy::Adaptive);
        let r = [ext(0), ext(1)];
        let _busy: Vec<InFlight> = (0..4).map(|_| l.start(1)).collect();
        for stripe in 0..100 {
            assert_eq!(l.choose(7, stripe, &r, &[], &[]).unwrap().node, 0);
        }
        l.failed(0);
        assert_eq!(l.choose(7, 3, &r, &[], &[]).unwrap().node, 1);
        // Avoided outright: only the other one; both avoided: none.
        assert_eq!(l.choose(7, 3, &r, &[1], &[]).unwrap().node, 0);
        assert_eq!(l.choose(7, 3, &r, &[0, 1], &[]), None);
    }

    #[test]
    fn a_node_where_qos_would_hold_the_read_back_is_passed_over_while_another_is_not() {
        for policy in [ReadPolicy::Static, ReadPolicy::Adaptive] {
            let (l, _) = loads(policy);
            let r = [ext(0), ext(1)];
            for stripe in 0..100 {
                assert_eq!(l.choose(7, stripe, &r, &[], &[0]).unwrap().node, 1);
                assert_eq!(l.choose(7, stripe, &r, &[], &[1]).unwrap().node, 0);
                // Held back everywhere: the read waits where it would have gone anyway.
                assert_eq!(
                    l.choose(7, stripe, &r, &[], &[0, 1]),
                    l.choose(7, stripe, &r, &[], &[])
                );
                // An avoided node is not brought back by the other's QoS.
                assert_eq!(l.choose(7, stripe, &r, &[1], &[0]).unwrap().node, 0);
            }
        }
    }

    #[test]
    fn a_failed_node_is_passed_over_for_a_time_that_doubles_per_failure_until_a_success() {
        let (l, clock) = loads(ReadPolicy::Static);
        let r = [ext(0), ext(1)];
        // A stripe the static policy reads from node 0.
        let stripe = (0..100)
            .find(|&k| l.choose(7, k, &r, &[], &[]).unwrap().node == 0)
            .expect("some stripe reads from node 0");
        let read_from = |l: &NodeLoads| l.choose(7, stripe, &r, &[], &[]).unwrap().node;
        let s = Duration::from_secs(1);

        l.failed(0);
        assert_eq!(read_from(&l), 1, "just failed");
        clock.advance(s * 2 - Duration::from_nanos(1));
        assert_eq!(read_from(&l), 1, "still within 2 s");
        clock.advance(Duration::from_nanos(1));
        assert_eq!(read_from(&l), 0, "2 s after one failure");

        // A second failure in a row: 4 s.
        l.failed(0);
        clock.advance(s * 3);
        assert_eq!(read_from(&l), 1, "3 s after the second failure in a row");
        clock.advance(s);
        assert_eq!(read_from(&l), 0, "4 s after it");

        // Many in a row: capped at 32 s.
        for _ in 0..10 {
            l.failed(0);
        }
        clock.advance(s * 31);
        assert_eq!(read_from(&l), 1);
        clock.advance(s);
        assert_eq!(read_from(&l), 0, "never longer than 32 s");

        // A success resets the count: the next failure costs 2 s again.
        l.start(0).done();
        l.failed(0);
        assert_eq!(read_from(&l), 1);
        clock.advance(s * 2);
        assert_eq!(read_from(&l), 0);
    }

    #[test]
    fn a_batchs_latency_is_what_the_clock_says_it_took() {
        let (l, clock) = loads(ReadPolicy::Adaptive);
        let r = [ext(0), ext(1)];
        let batch = l.start(0);
        clock.advance(Duration::from_micros(800));
        batch.done();
        let batch = l.start(1);
        clock.advance(Duration::from_micros(100));
        batch.done();
        assert_eq!(l.load(0).latency_ns.load(Ordering::Relaxed), 800_000);
        assert_eq!(l.load(1).latency_ns.load(Ordering::Relaxed), 100_000);
        // The faster node gets every read, whichever the static choice.
        for stripe in 0..50 {
            assert_eq!(l.choose(7, stripe, &r, &[], &[]).unwrap().node, 1);
        }
        // A failed batch is not sampled.
        let batch = l.start(1);
        clock.advance(Duration::from_secs(1));
        drop(batch);
        assert_eq!(l.load(1).latency_ns.load(Ordering::Relaxed), 100_000);
        assert_eq!(
            clock.now(),
            Duration::from_micros(900) + Duration::from_secs(1)
        );
    }
}
