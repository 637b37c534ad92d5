//! Covering a range with at most `k` tree nodes, wasting as few units as possible.
//!
//! A leaf locks exactly the requested bits, so it wastes nothing; an internal node locks its whole
//! span. The best cover is a small tree knapsack: only nodes on the two boundary paths are
//! partially covered, so the recursion visits O(h) nodes with an O(k^2) merge at each.

use crate::geometry::{Geometry, Node, LEAF_UNITS};

/// One node of a cover; for a leaf, `mask` holds the requested unit bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub node: Node,
    pub mask: u64,
}

/// (wasted units, pieces) of a cover.
type Cover = (u64, Vec<Piece>);

fn better(a: &Cover, b: &Cover) -> bool {
    (a.0, a.1.len()) < (b.0, b.1.len())
}

/// `best[j]`: the best cover of `[l, r) ∩ node` with at most `j` pieces.
fn solve(g: &Geometry, n: Node, l: u64, r: u64, k: usize) -> Vec<Option<Cover>> {
    let (s, e) = g.range(n);
    let inter = r.min(e).saturating_sub(l.max(s));
    if inter == 0 {
        return vec![Some((0, Vec::new())); k + 1];
    }
    let mut best: Vec<Option<Cover>> = vec![None; k + 1];
    if g.is_leaf(n) {
        let lo = l.max(s) - s;
        let hi = r.min(e) - s;
        let mask = if hi - lo == 64 {
            u64::MAX
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        for b in best.iter_mut().skip(1) {
            *b = Some((0, vec![Piece { node: n, mask }]));
        }
        return best;
    }
    let whole: Cover = (e - s - inter, vec![Piece { node: n, mask: 0 }]);
    if inter == e - s {
        for b in best.iter_mut().skip(1) {
            *b = Some(whole.clone());
        }
        return best;
    }
    // Merge the children's tables, knapsack style.
    let mut cur: Vec<Option<Cover>> = vec![Some((0, Vec::new())); k + 1];
    for c in 0..4 {
        let child = Node {
            level: n.level + 1,
            index: n.index * 4 + c,
        };
        let ct = solve(g, child, l, r, k);
        let mut next: Vec<Option<Cover>> = vec![None; k + 1];
        for j in 0..=k {
            for a in 0..=j {
                if let (Some(x), Some(y)) = (&cur[j - a], &ct[a]) {
                    let cand: Cover = (x.0 + y.0, x.1.iter().chain(&y.1).copied().collect());
                    if cand.1.len() <= j && next[j].as_ref().is_none_or(|b| better(&cand, b)) {
                        next[j] = Some(cand);
                    }
                }
            }
        }
        cur = next;
    }
    for j in 1..=k {
        best[j] = match &cur[j] {
            Some(c) if !better(&whole, c) => Some(c.clone()),
            _ => Some(whole.clone()),
        };
    }
    best
}

/// The best cover of `[l, r)` (inside the tree) with at most `k >= 1` pieces, in ascending
/// order of their ranges.
pub fn split(g: &Geometry, l: u64, r: u64, k: usize) -> Vec<Piece> {
    assert!(
        k >= 1 && l < r && r <= g.units(),
        "split of [{l}, {r}) in a tree of {}",
        g.units()
    );
    // Inside one leaf (every small I/O): that leaf with exactly the requested bits wastes
    // nothing with one piece, so nothing beats it.
    let first = l / LEAF_UNITS;
    if (r - 1) / LEAF_UNITS == first {
        let node = Node {
            level: g.height,
            index: first,
        };
        let (lo, hi) = (l % LEAF_UNITS, (r - 1) % LEAF_UNITS + 1);
        let mask = if hi - lo == LEAF_UNITS {
            u64::MAX
        } else {
            ((1u64 << (hi - lo)) - 1) << lo
        };
        return vec![Piece { node, mask }];
    }
    let mut pieces = solve(g, Geometry::root(), l, r, k)[k]
        .take()
        .expect("the root always covers")
        .1;
    pieces.sort_by_key(|p| g.range(p.node).0);
    pieces
}

/// Units a cover locks beyond `[l, r)`.
pub fn waste(g: &Geometry, pieces: &[Piece], l: u64, r: u64) -> u64 {
    pieces
        .iter()
        .filter(|p| !g.is_leaf(p.node))
        .map(|p| {
            let (s, e) = g.range(p.node);
            (e - s) - r.min(e).saturating_sub(l.max(s))
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_nodes(g: &Geometry) -> Vec<Node> {
        (0..=g.height)
            .flat_map(|level| (0..1u64 << (2 * level)).map(move |index| Node { level, index }))
            .collect()
    }

    /// Smallest waste over every set of at most `k` disjoint nodes covering `[l, r)`.
    fn brute_force(g: &Geometry, l: u64, r: u64, k: usize) -> u64 {
        let nodes: Vec<Node> = all_nodes(g)
            .into_iter()
            .filter(|n| {
                let (s, e) = g.range(*n);
                s < r && l < e
            })
            .collect();
        struct Search<'a> {
            g: &'a Geometry,
            nodes: &'a [Node],
            k: usize,
            l: u64,
            r: u64,
            best: u64,
        }
        impl Search<'_> {
            fn go(&mut self, i: usize, pick: &mut Vec<Node>) {
                let (g, l, r) = (self.g, self.l, self.r);
                let inter = |n: &Node| {
                    let (s, e) = g.range(*n);
                    r.min(e) - l.max(s)
                };
                if pick.iter().map(inter).sum::<u64>() == r - l {
                    let w = pick
                        .iter()
                        .filter(|n| !g.is_leaf(**n))
                        .map(|n| g.span(n.level) - inter(n))
                        .sum();
                    self.best = self.best.min(w);
                }
                if pick.len() == self.k {
                    return;
                }
                for j in i..self.nodes.len() {
                    let (s, e) = g.range(self.nodes[j]);
                    let disjoint = pick.iter().all(|p| {
                        let (ps, pe) = g.range(*p);
                        pe <= s || e <= ps
                    });
                    if disjoint {
                        pick.push(self.nodes[j]);
                        self.go(j + 1, pick);
                        pick.pop();
                    }
                }
            }
        }
        let mut search = Search {
            g,
            nodes: &nodes,
            k,
            l,
            r,
            best: u64::MAX,
        };
        search.go(0, &mut Vec::new());
        search.best
    }

    proptest! {
        #[test]
        fn split_is_optimal_against_brute_force(height in 0u32..3, a in 0u64..1024, b in 0u64..1024, k in 1usize..4) {
            let g = Geometry { height };
            let (l, r) = (a.min(b) % g.units(), (a.max(b) % g.units()) + 1);
            prop_assume!(l < r);
            let pieces = split(&g, l, r, k);
            prop_assert!(pieces.len() <= k);
            // Disjoint, and together they cover exactly the request (leaves by their masks).
            let mut covered = vec![false; g.units() as usize];
            for p in &pieces {
                let (s, e) = g.range(p.node);
                for u in s..e {
                    let taken = !g.is_leaf(p.node) || p.mask >> (u - s) & 1 == 1;
                    if taken {
                        prop_assert!(!covered[u as usize], "pieces overlap at {u}");
                        covered[u as usize] = true;
                    }
                }
            }
            prop_assert!((l..r).all(|u| covered[u as usize]));
            prop_assert_eq!(waste(&g, &pieces, l, r), brute_force(&g, l, r, k));
        }
    }

    #[test]
    fn examples() {
        let g = Geometry { height: 2 };
        // Aligned to a level-1 node: exactly that node.
        assert_eq!(
            split(&g, 256, 512, 2),
            vec![Piece {
                node: Node { level: 1, index: 1 },
                mask: 0
            }]
        );
        // Inside one leaf: the leaf with the requested bits.
        assert_eq!(
            split(&g, 3, 5, 2),
            vec![Piece {
                node: Node { level: 2, index: 0 },
                mask: 0b11000
            }]
        );
        // Straddling the middle with k = 1: the root; with k = 2: two leaves.
        assert_eq!(split(&g, 500, 530, 1)[0].node, Geometry::root());
        assert_eq!(split(&g, 500, 530, 2).len(), 2);
        assert_eq!(waste(&g, &split(&g, 500, 530, 2), 500, 530), 0);
    }
}
