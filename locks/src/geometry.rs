//! The shape of a lock tree and the layout of its 64-bit node words.
//!
//! A tree of height `h` is a perfect quaternary segment tree over `N = 64 * 4^h` lock units:
//! levels `0..=h`, level 0 the root, level `h` the leaves, each leaf covering 64 units. Nodes
//! are stored in level order in one flat array of 8-byte words, so navigation is arithmetic.

/// Units covered by one leaf (one bit each).
pub const LEAF_UNITS: u64 = 64;

/// A node: its level (0 = root) and its position within the level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node {
    pub level: u32,
    pub index: u64,
}

/// The shape of a lock tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Levels above the leaves.
    pub height: u32,
}

impl Geometry {
    /// The smallest tree covering at least `units` units.
    pub fn for_units(units: u64) -> Geometry {
        let mut height = 0;
        while (LEAF_UNITS << (2 * height)) < units {
            height += 1;
        }
        Geometry { height }
    }

    /// Units covered by the whole tree (`N`).
    pub fn units(&self) -> u64 {
        LEAF_UNITS << (2 * self.height)
    }

    /// Number of nodes: (4^(h+1) - 1) / 3.
    pub fn nodes(&self) -> u64 {
        ((1u64 << (2 * (self.height + 1))) - 1) / 3
    }

    /// Flat index of the first node of `level`.
    pub fn level_start(level: u32) -> u64 {
        ((1u64 << (2 * level)) - 1) / 3
    }

    /// Flat index of `n` in the node array.
    pub fn flat(&self, n: Node) -> u64 {
        Self::level_start(n.level) + n.index
    }

    pub fn is_leaf(&self, n: Node) -> bool {
        n.level == self.height
    }

    /// Units covered by one node of `level`.
    pub fn span(&self, level: u32) -> u64 {
        LEAF_UNITS << (2 * (self.height - level))
    }

    /// The units `[start, end)` node `n` covers.
    pub fn range(&self, n: Node) -> (u64, u64) {
        let s = self.span(n.level);
        (n.index * s, (n.index + 1) * s)
    }

    pub fn root() -> Node {
        Node { level: 0, index: 0 }
    }

    /// Ancestors of `n`, parent first.
    pub fn ancestors(&self, n: Node) -> Vec<Node> {
        (0..n.level)
            .rev()
            .map(|level| Node {
                level,
                index: n.index >> (2 * (n.level - level)),
            })
            .collect()
    }

    /// The ancestors a locker of `n` notifies (adds to their `DMax`): its `m` nearest, and every
    /// ancestor on a *beacon level* (internal levels `1..h` divisible by `m`). See the crate docs
    /// for why this closes the gap of the restated protocol.
    pub fn notify_set(&self, n: Node, m: u32) -> Vec<Node> {
        self.ancestors(n)
            .into_iter()
            .filter(|a| n.level - a.level <= m || (a.level >= 1 && a.level % m == 0))
            .collect()
    }

    /// The descendant levels a checker at `n` reads: `n.level+1 ..= n.level+m`, internal levels
    /// only (leaves carry no counters). For each: (level, first index, count).
    pub fn check_window(&self, n: Node, m: u32) -> Vec<(u32, u64, u64)> {
        (n.level + 1..=(n.level + m).min(self.height.saturating_sub(1)))
            .filter(|&l| l > n.level && l < self.height)
            .map(|level| {
                let d = level - n.level;
                (level, n.index << (2 * d), 1u64 << (2 * d))
            })
            .collect()
    }
}

/// Fields of an internal node word. Masked FAA with [`word::BOUNDARY`] adds to each field
/// independently (a field's low bit is a boundary); counters wrap within their width and are
/// compared for equality only, so wrap-around is harmless while fewer than 2^width requests
/// are outstanding on one node.
pub mod word {
    pub const TCNT_SHIFT: u32 = 0;
    pub const TMAX_SHIFT: u32 = 14;
    pub const T_BITS: u32 = 14;
    pub const DCNT_SHIFT: u32 = 28;
    pub const DMAX_SHIFT: u32 = 45;
    pub const D_BITS: u32 = 17;
    pub const OCC_BIT: u32 = 62;
    pub const EXP_BIT: u32 = 63;
    /// Low-boundary mask of the six fields (bit 0 is implicitly a boundary).
    pub const BOUNDARY: u64 =
        1 << TMAX_SHIFT | 1 << DCNT_SHIFT | 1 << DMAX_SHIFT | 1 << OCC_BIT | 1 << EXP_BIT;
    /// The TCnt and TMax fields together.
    pub const T_MASK: u64 = (1 << (2 * T_BITS)) - 1;
    pub const TMAX_MASK: u64 = ((1 << T_BITS) - 1) << TMAX_SHIFT;

    fn field(w: u64, shift: u32, bits: u32) -> u64 {
        (w >> shift) & ((1 << bits) - 1)
    }
    pub fn tcnt(w: u64) -> u64 {
        field(w, TCNT_SHIFT, T_BITS)
    }
    pub fn tmax(w: u64) -> u64 {
        field(w, TMAX_SHIFT, T_BITS)
    }
    pub fn dcnt(w: u64) -> u64 {
        field(w, DCNT_SHIFT, D_BITS)
    }
    pub fn dmax(w: u64) -> u64 {
        field(w, DMAX_SHIFT, D_BITS)
    }
    pub fn occ(w: u64) -> bool {
        w >> OCC_BIT & 1 == 1
    }
    pub fn exp(w: u64) -> bool {
        w >> EXP_BIT & 1 == 1
    }
    /// No notified descendant request is outstanding.
    pub fn drained(w: u64) -> bool {
        dcnt(w) == dmax(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_verbs::masked::masked_faa;

    #[test]
    fn shape() {
        let g = Geometry { height: 2 };
        assert_eq!((g.units(), g.nodes()), (1024, 21));
        assert_eq!(g.flat(Node { level: 2, index: 3 }), 8);
        assert_eq!(g.range(Node { level: 1, index: 2 }), (512, 768));
        assert_eq!(Geometry::for_units(1025), Geometry { height: 3 });
        assert_eq!(Geometry::for_units(1), Geometry { height: 0 });
        let leaf = Node {
            level: 2,
            index: 13,
        };
        assert_eq!(
            g.ancestors(leaf),
            vec![Node { level: 1, index: 3 }, Geometry::root()]
        );
    }

    #[test]
    fn fields_add_independently_and_wrap() {
        let mut w = 0u64;
        for _ in 0..(1 << word::T_BITS) {
            w = masked_faa(w, 1 << word::TMAX_SHIFT, word::BOUNDARY);
        }
        assert_eq!(w, 0, "TMax wrapped without carrying into DCnt");
        w = masked_faa(
            w,
            1 << word::OCC_BIT | 1 << word::DMAX_SHIFT,
            word::BOUNDARY,
        );
        assert!(word::occ(w) && !word::drained(w));
        w = masked_faa(
            w,
            1 << word::OCC_BIT | 1 << word::DCNT_SHIFT,
            word::BOUNDARY,
        );
        assert!(!word::occ(w) && word::drained(w) && !word::exp(w));
    }

    /// The gap: for every tree height, every ancestor/descendant pair is seen by the checker,
    /// directly (the descendant notifies it) or through a beacon level inside its window.
    #[test]
    fn every_descendant_is_visible_to_every_checker() {
        for m in 1..=5 {
            for height in 0..=10 {
                let g = Geometry { height };
                for dl in 1..=height {
                    let d = Node {
                        level: dl,
                        index: 0,
                    };
                    let notified = g.notify_set(d, m);
                    for a in g.ancestors(d) {
                        let direct = notified.contains(&a);
                        let window = g.check_window(a, m);
                        let via_beacon = notified.iter().any(|x| {
                            window.iter().any(|&(l, first, count)| {
                                x.level == l && (first..first + count).contains(&x.index)
                            })
                        });
                        assert!(
                            direct || via_beacon,
                            "m={m} h={height}: node at level {dl} hidden from ancestor at level {}",
                            a.level
                        );
                    }
                }
            }
        }
    }
}
