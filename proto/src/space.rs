//! How much a user can store: the memory nodes' raw capacity and free memory turned into what
//! files with a given replica count and stripe unit can fill, as the metadata service places
//! their stripes.
//!
//! Placement (`rackfs_meta::file`) puts each of a stripe's `r` replicas on a different data
//! node, each in one extent of the stripe unit plus the stripe's owner tag
//! ([`crate::record::TAG_SPACE`]), and fills nodes in whatever proportion they have room: so
//! the number of whole stripes the nodes can take with every replica in place is the largest
//! `S` with `sum_i min(n_i, S) >= r * S`, where `n_i` is how many extents node `i` can hold.
//! With equal nodes that is the raw space divided by `r`; with unequal ones less, since no
//! node holds two replicas of one stripe (two replicas over 1 GiB and 3 GiB nodes: 1 GiB, not
//! 2). Beyond that point placement still gives stripes fewer replicas (degraded) on the nodes
//! with room left, so a write fails with `ENOSPC` only once no node can take a stripe; the
//! usable figure is what can be written *with* the asked redundancy, as Ceph's `MAX AVAIL` is.

use serde::{Deserialize, Serialize};

use crate::record::{EXTENT_GRANULE, TAG_SPACE};

/// One data node's memory for file data (its region past the metadata area).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpace {
    pub node: u32,
    /// Bytes its allocator manages (the QoS area and lock trees are allocated from them).
    pub capacity: u64,
    /// Bytes not allocated, or quarantined (an allocation waits for the quarantine rather than
    /// failing, so those are writable too).
    pub free: u64,
}

/// Capacity and free space as files of one replica count and stripe unit can fill them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usable {
    /// What files could hold on the empty nodes.
    pub capacity: u64,
    /// What can still be written (never above `capacity`).
    pub free: u64,
    /// The replica count the figures are for: the one asked, at most the nodes counted.
    pub replicas: u32,
}

/// The largest number of stripes of `replicas` copies each, every copy on a different node,
/// that nodes holding `extents[i]` extents each can take (see the module docs).
pub fn placeable_stripes(extents: &[u64], replicas: u32) -> u64 {
    let r = replicas.max(1) as u128;
    let fits = |s: u64| extents.iter().map(|&n| n.min(s) as u128).sum::<u128>() >= r * s as u128;
    // `fits` holds on [0, max] and nowhere above (sum_i min(n_i, S) - r*S is concave and 0 at
    // S = 0), and max <= sum / r: a binary search.
    let (mut lo, mut hi) = (
        0u64,
        (extents.iter().map(|&n| n as u128).sum::<u128>() / r) as u64,
    );
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Node memory one stripe replica of `stripe_unit` bytes takes: the unit, its owner tag, in
/// allocation granules.
pub fn extent_len(stripe_unit: u64) -> u64 {
    (stripe_unit.max(1) + TAG_SPACE).next_multiple_of(EXTENT_GRANULE)
}

/// What files of `replicas` copies (at most `nodes.len()`: placement never puts two on one
/// node, and a file asking more gets one per node) and `stripe_unit`-byte stripes can fill of
/// `nodes`, in whole stripes.
pub fn usable(nodes: &[NodeSpace], replicas: u32, stripe_unit: u64) -> Usable {
    let r = replicas.clamp(1, nodes.len().max(1) as u32);
    let ext = extent_len(stripe_unit);
    let bytes = |of: &dyn Fn(&NodeSpace) -> u64| {
        let n: Vec<u64> = nodes.iter().map(|s| of(s) / ext).collect();
        placeable_stripes(&n, r).saturating_mul(stripe_unit)
    };
    let capacity = bytes(&|s| s.capacity);
    Usable {
        capacity,
        // A node's free memory never exceeds its capacity; min() keeps f_bfree <= f_blocks
        // even when figures from different moments meet.
        free: bytes(&|s| s.free.min(s.capacity)).min(capacity),
        replicas: r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn node(node: u32, free_mib: u64) -> NodeSpace {
        NodeSpace {
            node,
            capacity: 64 * MIB * 1024,
            free: free_mib * MIB,
        }
    }

    #[test]
    fn two_replicas_on_equal_nodes_hold_half_the_raw_space() {
        let nodes = [node(0, 1024), node(1, 1024)];
        let u = usable(&nodes, 2, MIB);
        // Each 1 MiB extent carries its 64-byte tag: 1023 fit in 1 GiB, not 1024.
        assert_eq!(u.free, 1023 * MIB);
        assert_eq!(u.replicas, 2);
        assert_eq!(usable(&nodes, 1, MIB).free, 2 * 1023 * MIB);
    }

    #[test]
    fn two_replicas_on_unequal_nodes_are_bounded_by_the_smaller_ones() {
        // No node holds two copies of a stripe: the 3 GiB node's surplus takes no stripe.
        assert_eq!(
            usable(&[node(0, 1024), node(1, 3072)], 2, MIB).free,
            1023 * MIB
        );
        // Three nodes, two replicas: min(total/2, total - largest).
        let three = [node(0, 1000), node(1, 1000), node(2, 4000)];
        assert_eq!(placeable_stripes(&[1000, 1000, 4000], 2), 2000);
        assert_eq!(placeable_stripes(&[1000, 1500, 2000], 2), 2250);
        assert!(usable(&three, 2, MIB).free <= 2000 * MIB);
    }

    #[test]
    fn more_replicas_than_nodes_count_one_copy_per_node() {
        let u = usable(&[node(0, 100), node(1, 100)], 4, MIB);
        assert_eq!(u.replicas, 2);
        assert_eq!(u.free, 99 * MIB);
        let none = usable(&[], 2, MIB);
        assert_eq!((none.capacity, none.free), (0, 0), "no node, no space");
    }

    proptest! {
        /// The count is placeable (greedy: each stripe on the r nodes with most room left)
        /// and one more is not.
        #[test]
        fn placeable_stripes_is_what_greedy_placement_reaches(
            n in proptest::collection::vec(0u64..40, 1..6),
            r in 1u32..4,
        ) {
            prop_assume!(r as usize <= n.len());
            let mut left = n.clone();
            let mut placed = 0;
            loop {
                left.sort_unstable_by(|a, b| b.cmp(a));
                if left[r as usize - 1] == 0 {
                    break;
                }
                for x in left.iter_mut().take(r as usize) {
                    *x -= 1;
                }
                placed += 1;
            }
            prop_assert_eq!(placeable_stripes(&n, r), placed);
        }

        #[test]
        fn free_is_at_most_capacity(
            f in proptest::collection::vec((0u64..4096, 0u64..4096), 0..5),
            r in 1u32..5,
            unit_kib in 1u64..2048,
        ) {
            let nodes: Vec<NodeSpace> = f
                .iter()
                .enumerate()
                .map(|(i, &(c, x))| NodeSpace { node: i as u32, capacity: c * 4096 * 64, free: x * 4096 * 64 })
                .collect();
            let u = usable(&nodes, r, unit_kib * 4096);
            prop_assert!(u.free <= u.capacity);
            let raw: u64 = nodes.iter().map(|s| s.capacity).sum();
            prop_assert!(u.capacity <= raw / u.replicas as u64);
        }
    }
}
