//! pShift: splitting each mount's reservation across memory nodes by its demand there.
//!
//! Mounts are pShift's *buckets*, memory nodes its *servers*. Given each mount's reservation
//! `R_i`, its recent demand `d_i^j` on each node and each node's capacity `C^j` (all in tokens
//! per period), find an allocation `a_i^j` with `sum_j a_i^j = R_i` that maximizes the tokens
//! the nodes can actually consume, `Phi = sum_j min(C^j, sum_i min(a_i^j, d_i^j))`.
//!
//! The algorithm (Peng & Varman): start from the *prudent* allocation proportional to demand
//! (`a <= d` everywhere), then repeatedly move tokens from an overloaded node to an underloaded
//! one along a *shift path* found by breadth-first search in the token transfer graph (an edge
//! `j -> k` when some mount has tokens on `j` and spare demand on `k`). Each move raises `Phi` by
//! the amount moved; an allocation without a shift path is optimal. A mount whose demand is
//! below its reservation is first cut to its demand (nothing can do better); the rest of its
//! reservation is spread over the nodes in proportion to their spare capacity afterwards, so
//! `sum_j a_i^j = R_i` still holds.
//!
//! The approximation ([`Options::top`]) builds edges from only the `top` mounts with the most
//! tokens on the donor node, for large instances.

use std::collections::VecDeque;

/// An allocation problem.
#[derive(Clone, Debug)]
pub struct Problem {
    /// Reservation per mount (tokens per period).
    pub reservation: Vec<u64>,
    /// Demand per mount per node: `demand[i][j]`.
    pub demand: Vec<Vec<u64>>,
    /// Capacity per node.
    pub capacity: Vec<u64>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Consider only this many mounts (those with the most tokens on the donor) per edge.
    pub top: Option<usize>,
}

/// Tokens the nodes can consume under allocation `a`.
pub fn phi(p: &Problem, a: &[Vec<u64>]) -> u64 {
    (0..p.capacity.len())
        .map(|j| {
            let used: u64 = (0..p.reservation.len())
                .map(|i| a[i][j].min(p.demand[i][j]))
                .sum();
            used.min(p.capacity[j])
        })
        .sum()
}

/// Splits `total` over `weights` in proportion, never giving a slot more than `caps`, with the
/// rounding remainder going to the slots with the largest fractional parts that still have room.
fn proportional(total: u64, weights: &[u64], caps: &[u64]) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| w as u128).sum();
    let mut out = vec![0u64; weights.len()];
    if sum == 0 || total == 0 {
        return out;
    }
    let mut given = 0u64;
    let mut frac: Vec<(u128, usize)> = Vec::new();
    for (j, &w) in weights.iter().enumerate() {
        let exact = total as u128 * w as u128;
        out[j] = ((exact / sum) as u64).min(caps[j]);
        given += out[j];
        frac.push((exact % sum, j));
    }
    frac.sort_by_key(|f| std::cmp::Reverse(f.0));
    let mut left = total - given;
    while left > 0 {
        let mut moved = false;
        for &(_, j) in &frac {
            if left == 0 {
                break;
            }
            if out[j] < caps[j] {
                out[j] += 1;
                left -= 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    out
}

/// The optimal allocation (see the module docs).
pub fn allocate(p: &Problem, opt: Options) -> Vec<Vec<u64>> {
    let (nb, ns) = (p.reservation.len(), p.capacity.len());
    // Reservations beyond demand cannot be consumed: allocate min(R, D) prudently.
    let want: Vec<u64> = (0..nb)
        .map(|i| p.reservation[i].min(p.demand[i].iter().sum()))
        .collect();
    let mut a: Vec<Vec<u64>> = (0..nb)
        .map(|i| proportional(want[i], &p.demand[i], &p.demand[i]))
        .collect();
    let load = |a: &Vec<Vec<u64>>, j: usize| -> u64 { (0..nb).map(|i| a[i][j]).sum() };
    loop {
        let over: Vec<usize> = (0..ns).filter(|&j| load(&a, j) > p.capacity[j]).collect();
        if over.is_empty() {
            break;
        }
        let under: Vec<bool> = (0..ns).map(|k| load(&a, k) < p.capacity[k]).collect();
        // BFS from all overloaded nodes at once; the first underloaded node reached ends a
        // shortest shift path.
        let edge = |j: usize, k: usize, a: &Vec<Vec<u64>>| -> (u64, Vec<usize>) {
            let mut movable: Vec<(u64, usize)> = (0..nb)
                .map(|i| (a[i][j].min(p.demand[i][k] - a[i][k]), i))
                .filter(|&(w, _)| w > 0)
                .collect();
            if let Some(top) = opt.top {
                movable.sort_by_key(|&(_, i)| std::cmp::Reverse(a[i][j]));
                movable.truncate(top);
            }
            (
                movable.iter().map(|m| m.0).sum(),
                movable.iter().map(|m| m.1).collect(),
            )
        };
        let mut prev: Vec<Option<usize>> = vec![None; ns];
        let mut seen = vec![false; ns];
        let mut queue: VecDeque<usize> = VecDeque::new();
        for &j in &over {
            seen[j] = true;
            queue.push_back(j);
        }
        let mut target = None;
        'bfs: while let Some(j) = queue.pop_front() {
            for k in 0..ns {
                if seen[k] || edge(j, k, &a).0 == 0 {
                    continue;
                }
                seen[k] = true;
                prev[k] = Some(j);
                if under[k] {
                    target = Some(k);
                    break 'bfs;
                }
                queue.push_back(k);
            }
        }
        let Some(end) = target else { break };
        let mut path = vec![end];
        while let Some(j) = prev[*path.last().expect("path")] {
            path.push(j);
        }
        path.reverse();
        let start = path[0];
        let mut amount = (load(&a, start) - p.capacity[start]).min(p.capacity[end] - load(&a, end));
        for w in path.windows(2) {
            amount = amount.min(edge(w[0], w[1], &a).0);
        }
        // Move `amount` along each edge, mount by mount.
        for w in path.windows(2) {
            let (j, k) = (w[0], w[1]);
            let mut left = amount;
            for i in edge(j, k, &a).1 {
                let m = a[i][j].min(p.demand[i][k] - a[i][k]).min(left);
                a[i][j] -= m;
                a[i][k] += m;
                left -= m;
                if left == 0 {
                    break;
                }
            }
        }
    }
    // Reservation beyond demand: spread over the nodes' remaining room (it cannot be used
    // there now, but the mount keeps its reservation if its demand moves).
    for i in 0..nb {
        let rest = p.reservation[i] - want[i];
        if rest > 0 {
            let room: Vec<u64> = (0..ns)
                .map(|j| p.capacity[j].saturating_sub(load(&a, j)).max(1))
                .collect();
            let extra = proportional(rest, &room, &vec![u64::MAX; ns]);
            for j in 0..ns {
                a[i][j] += extra[j];
            }
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The best Phi over every split of every reservation (tiny instances only).
    fn brute_force(p: &Problem) -> u64 {
        fn splits(total: u64, parts: usize) -> Vec<Vec<u64>> {
            if parts == 1 {
                return vec![vec![total]];
            }
            (0..=total)
                .flat_map(|x| {
                    splits(total - x, parts - 1).into_iter().map(move |mut s| {
                        s.insert(0, x);
                        s
                    })
                })
                .collect()
        }
        let per: Vec<Vec<Vec<u64>>> = p
            .reservation
            .iter()
            .map(|&r| splits(r, p.capacity.len()))
            .collect();
        let mut best = 0;
        let mut idx = vec![0usize; per.len()];
        loop {
            let a: Vec<Vec<u64>> = idx.iter().zip(&per).map(|(&k, s)| s[k].clone()).collect();
            best = best.max(phi(p, &a));
            let mut b = 0;
            loop {
                if b == idx.len() {
                    return best;
                }
                idx[b] += 1;
                if idx[b] < per[b].len() {
                    break;
                }
                idx[b] = 0;
                b += 1;
            }
        }
    }

    fn problem() -> impl Strategy<Value = Problem> {
        (1usize..=3, 1usize..=3).prop_flat_map(|(nb, ns)| {
            (
                proptest::collection::vec(0u64..=6, nb),
                proptest::collection::vec(proptest::collection::vec(0u64..=6, ns), nb),
                proptest::collection::vec(0u64..=8, ns),
            )
                .prop_map(|(reservation, demand, capacity)| Problem {
                    reservation,
                    demand,
                    capacity,
                })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn optimal_against_brute_force(p in problem()) {
            let a = allocate(&p, Options::default());
            for (i, row) in a.iter().enumerate() {
                prop_assert_eq!(row.iter().sum::<u64>(), p.reservation[i], "mount {} keeps its reservation", i);
            }
            prop_assert_eq!(phi(&p, &a), brute_force(&p));
        }

        #[test]
        fn approximation_keeps_reservations_and_never_beats_optimal(p in problem()) {
            let a = allocate(&p, Options { top: Some(1) });
            for (i, row) in a.iter().enumerate() {
                prop_assert_eq!(row.iter().sum::<u64>(), p.reservation[i]);
            }
            prop_assert!(phi(&p, &a) <= brute_force(&p));
        }
    }

    #[test]
    fn brokered_transfer_through_a_middle_node() {
        // Node 0 is overloaded with red and green, node 2 underloaded; neither red nor green
        // has demand on node 2, so red moves to node 1 and blue moves on from node 1 to node 2.
        let p = Problem {
            reservation: vec![4, 4, 4],
            demand: vec![vec![4, 4, 0], vec![0, 4, 4], vec![4, 0, 0]],
            capacity: vec![4, 4, 4],
        };
        let a = allocate(&p, Options::default());
        assert_eq!(phi(&p, &a), 12);
        assert_eq!(a, vec![vec![0, 4, 0], vec![0, 0, 4], vec![4, 0, 0]]);
    }
}
