//! Cluster QoS placement, the primary's controller logic: admission control of mounts'
//! reservations and limits (IOPS), and each period the pShift placement of every mount's
//! reservation over the nodes by its demand on each (the daemon pushes the result to the
//! nodes' monitors).
//!
//! Units: mount options and admission are in IOPS (tokens per second); monitors and engines
//! count tokens per period (`IOPS * period`).

use std::collections::BTreeMap;
use std::time::Duration;

use rackfs_proto::control::{ErrorCode, QosMount, QosNodeStatus};
use rackfs_proto::Refusal;
use rackfs_qos::pshift::{self, Problem};

/// A mount's limit of `limit` IOPS (0: none) split over the nodes for one period: the whole
/// limit over the nodes it asked for tokens on, in proportion to its demand on each, so a
/// mount that keeps its demand where it was reaches its limit exactly (its reads pass a node
/// whose share is spent for another replica's). A node it does not work on keeps a floor of
/// a fiftieth of an even share beyond that (it can start there at once; the next placement
/// follows), so a period in which it moves to new nodes may exceed the limit by at most 2%.
/// With no demand anywhere, an even split. Never below its reservation share `alloc` there.
pub fn split_limit(limit: u64, demand: &[u64], alloc: &[u64], period: Duration) -> Vec<u64> {
    if limit == 0 {
        return vec![0; demand.len()];
    }
    let n = demand.len().max(1) as u64;
    let total = per_period(limit, period).max(1);
    let d: u128 = demand.iter().map(|&x| x as u128).sum();
    let mut shares: Vec<u64> = if d == 0 {
        vec![total / n; demand.len()]
    } else {
        let floor = total / (50 * n);
        let mut s: Vec<u64> = demand
            .iter()
            .map(|&dj| match dj {
                0 => floor,
                _ => (total as u128 * dj as u128 / d) as u64,
            })
            .collect();
        // What rounding down left goes to the busiest node, so the busy nodes' shares add up
        // to the limit.
        let busy: u64 = s
            .iter()
            .zip(demand)
            .filter(|(_, &dj)| dj > 0)
            .map(|(x, _)| x)
            .sum();
        if let Some(top) = (0..demand.len()).max_by_key(|&j| demand[j]) {
            s[top] += total - busy;
        }
        s
    };
    for (share, &aj) in shares.iter_mut().zip(alloc) {
        *share = (*share).max(aj).max(1);
    }
    shares
}

/// Tokens per period of `iops` over `period`.
pub fn per_period(iops: u64, period: Duration) -> u64 {
    (iops as u128 * period.as_micros() / 1_000_000) as u64
}

/// Shares placed on each node: per node, (slot, reservation, limit, weight); tokens per period.
pub type Placement = BTreeMap<u32, Vec<(u16, u64, u64, u32)>>;

/// A mount's admitted QoS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountQos {
    pub session: u64,
    pub reservation: u64,
    pub limit: u64,
    pub weight: u32,
}

/// When a slot's current mount took it: its session and, per node, the last period finished
/// before then.
type Since = (u64, Vec<(u32, u64)>);

/// The primary's QoS controller (see the module docs).
#[derive(Default)]
pub struct ClusterQos {
    pub mounts: BTreeMap<u16, MountQos>,
    /// The last placement.
    pub placed: Placement,
    /// Split reservations evenly instead of by demand (experiments: pShift off).
    pub even_split: bool,
    /// Per slot, when its current mount took it (reports leave out earlier periods).
    since: BTreeMap<u16, Since>,
}

impl ClusterQos {
    /// A controller with no mounts; `even_split` splits reservations evenly instead of by
    /// demand (experiments: pShift off).
    pub fn new(even_split: bool) -> ClusterQos {
        ClusterQos {
            even_split,
            ..ClusterQos::default()
        }
    }

    /// Admission control for `slot` asking `reservation` and `limit` IOPS, given the nodes'
    /// capacities and the largest rate one mount can reach (both IOPS).
    pub fn admit(
        &mut self,
        slot: u16,
        q: MountQos,
        nodes: &[QosNodeStatus],
    ) -> Result<(), Refusal> {
        if q.limit > 0 && q.limit < q.reservation {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!(
                    "limit {} IOPS is below reservation {} IOPS",
                    q.limit, q.reservation
                ),
            ));
        }
        if q.weight == 0 {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "weight must be at least 1",
            ));
        }
        let iops = |n: &QosNodeStatus| n.capacity * 1000 / n.period_ms.max(1);
        let capacity: u64 = nodes.iter().map(iops).sum();
        let others: u64 = self
            .mounts
            .iter()
            .filter(|(&s, _)| s != slot)
            .map(|(_, m)| m.reservation)
            .sum();
        if others + q.reservation > capacity {
            return Err(Refusal::new(
                ErrorCode::Refused,
                format!(
                    "reservation {} IOPS refused by the aggregate constraint: the cluster's \
                     capacity is {capacity} IOPS and {others} IOPS are reserved by other \
                     mounts, so at most {} IOPS can be reserved now",
                    q.reservation,
                    capacity.saturating_sub(others)
                ),
            ));
        }
        // Local constraint: one mount reaches each node at most at client_iops.
        let local: u64 = nodes.iter().map(|n| n.client_iops.min(iops(n))).sum();
        if q.reservation > local {
            return Err(Refusal::new(
                ErrorCode::Refused,
                format!(
                    "reservation {} IOPS refused by the local constraint: one mount can do at \
                     most {local} IOPS over the {} memory node(s), {} IOPS short",
                    q.reservation,
                    nodes.len(),
                    q.reservation - local
                ),
            ));
        }
        if self.since.get(&slot).is_none_or(|s| s.0 != q.session) {
            let periods = nodes
                .iter()
                .map(|n| (n.node_id, n.periods.last().map_or(0, |p| p.period)))
                .collect();
            self.since.insert(slot, (q.session, periods));
        }
        self.mounts.insert(slot, q);
        Ok(())
    }

    /// Forgets the mount of an ended session.
    pub fn end_session(&mut self, session: u64) -> bool {
        let before = self.mounts.len();
        self.mounts.retain(|_, m| m.session != session);
        before != self.mounts.len()
    }

    /// Places every mount's reservation and limit over `nodes` by its demand in their last
    /// period (pShift); mounts with no recent demand are split evenly. Returns each node's
    /// shares: (slot, reservation, limit) in tokens per period.
    pub fn place(&mut self, nodes: &[QosNodeStatus]) -> Placement {
        let slots: Vec<u16> = self.mounts.keys().copied().collect();
        let n = nodes.len().max(1) as u64;
        let demand: Vec<Vec<u64>> = slots
            .iter()
            .map(|s| {
                nodes
                    .iter()
                    .map(|node| {
                        if self.even_split {
                            return 0;
                        }
                        node.periods.last().map_or(0, |p| {
                            p.mounts.iter().find(|m| m.0 == *s).map_or(0, |m| m.4)
                        })
                    })
                    .collect()
            })
            .collect();
        let period = |node: &QosNodeStatus| Duration::from_millis(node.period_ms);
        let reservation: Vec<u64> = slots
            .iter()
            .map(|s| per_period(self.mounts[s].reservation, period(&nodes[0])))
            .collect();
        // A mount without demand anywhere gets an even split (as demand) so it keeps its
        // reservation everywhere until it shows where it works. One that asked for less than
        // its reservation (it may have been held back: demand is measured in a closed loop)
        // has its demand scaled up to the reservation, in the same proportions.
        let demand: Vec<Vec<u64>> = demand
            .into_iter()
            .zip(&reservation)
            .map(|(d, &r)| {
                let total: u64 = d.iter().sum();
                if total == 0 {
                    vec![r.div_ceil(n); d.len()]
                } else if total < r {
                    d.iter()
                        .map(|&x| (x as u128 * r as u128).div_ceil(total as u128) as u64)
                        .collect()
                } else {
                    d
                }
            })
            .collect();
        let problem = Problem {
            reservation: reservation.clone(),
            demand: demand.clone(),
            capacity: nodes.iter().map(|n| n.capacity).collect(),
        };
        let alloc = pshift::allocate(&problem, pshift::Options::default());
        let mut out = Placement::new();
        for (i, s) in slots.iter().enumerate() {
            let m = self.mounts[s];
            let limits = split_limit(m.limit, &demand[i], &alloc[i], period(&nodes[0]));
            for (j, node) in nodes.iter().enumerate() {
                out.entry(node.node_id)
                    .or_default()
                    .push((*s, alloc[i][j], limits[j], m.weight));
            }
        }
        for node in nodes {
            out.entry(node.node_id).or_default();
        }
        self.placed = out.clone();
        out
    }

    /// The admitted mounts with their current placement.
    pub fn report(&self) -> Vec<QosMount> {
        self.mounts
            .iter()
            .map(|(&slot, m)| QosMount {
                slot,
                reservation: m.reservation,
                limit: m.limit,
                weight: m.weight,
                shares: self
                    .placed
                    .iter()
                    .filter_map(|(&node, v)| v.iter().find(|e| e.0 == slot).map(|e| (node, e.1)))
                    .collect(),
                since: self.since.get(&slot).map_or_else(Vec::new, |s| s.1.clone()),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_proto::control::QosPeriod;

    fn node(id: u32, demand: &[(u16, u64)]) -> QosNodeStatus {
        QosNodeStatus {
            node_id: id,
            period_ms: 1000,
            capacity: 10_000,
            profiled: true,
            client_iops: 10_000,
            periods: vec![QosPeriod {
                period: 1,
                capacity: 10_000,
                mounts: demand.iter().map(|&(s, d)| (s, 0, d, 0, d)).collect(),
                ..QosPeriod::default()
            }],
        }
    }

    fn share(p: &Placement, node: u32, slot: u16) -> u64 {
        p[&node].iter().find(|x| x.0 == slot).map_or(0, |x| x.1)
    }

    #[test]
    fn a_limit_splits_evenly_without_demand_and_by_demand_with_it() {
        let p = Duration::from_secs(1);
        // No demand anywhere (a fresh mount): an even split, not a token each.
        assert_eq!(split_limit(2000, &[0, 0], &[0, 0], p), vec![1000, 1000]);
        // Demand on node 1 only: it has the whole limit; node 0 keeps a fiftieth of an even
        // share beyond it.
        let l = split_limit(2000, &[0, 500], &[0, 0], p);
        assert_eq!(l, vec![20, 2000]);
        // Demand on two of three nodes: split by demand, to the token.
        let l = split_limit(2000, &[300, 0, 400], &[0, 0, 0], p);
        assert_eq!(l, vec![857, 13, 1143]);
        assert_eq!(l[0] + l[2], 2000);
        // Never below the reservation share.
        assert_eq!(split_limit(2000, &[0, 500], &[600, 0], p), vec![600, 2000]);
        // Whatever the demand, the nodes with demand share exactly the limit, and the others
        // at most 2% of it together.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let demand: Vec<u64> = (0..1 + x % 5)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 33) % 3 * (x >> 40) % 5000
                })
                .collect();
            let limit = 1 + (x >> 20) % 50_000;
            let l = split_limit(limit, &demand, &vec![0; demand.len()], p);
            let busy: u64 = (0..l.len()).filter(|&j| demand[j] > 0).map(|j| l[j]).sum();
            let idle: u64 = l.iter().sum::<u64>() - busy;
            if demand.iter().any(|&d| d > 0) {
                // (A node with demand has a token at least: a share of 0 means no limit.)
                assert!(
                    busy >= limit && busy <= limit + l.len() as u64,
                    "{demand:?} {l:?}"
                );
                assert!(idle <= (limit / 50).max(l.len() as u64), "{demand:?} {l:?}");
            }
        }
        // No limit.
        assert_eq!(split_limit(0, &[3, 4], &[1, 1], p), vec![0, 0]);
    }

    #[test]
    fn a_reused_slot_reports_only_its_new_mounts_periods() {
        let at = |period: u64| {
            let mut n = node(0, &[(0, 10)]);
            n.periods[0].period = period;
            vec![n]
        };
        let q = |session| MountQos {
            session,
            reservation: 100,
            limit: 0,
            weight: 1,
        };
        let mut c = ClusterQos::default();
        c.admit(0, q(1), &at(5)).unwrap();
        assert_eq!(c.report()[0].since, vec![(0, 5)]);
        // `rackfs qos set` on the same mount keeps its history.
        c.admit(0, q(1), &at(9)).unwrap();
        assert_eq!(c.report()[0].since, vec![(0, 5)]);
        // Another mount in the slot starts afresh.
        assert!(c.end_session(1));
        c.admit(0, q(2), &at(12)).unwrap();
        assert_eq!(c.report()[0].since, vec![(0, 12)]);
    }

    #[test]
    fn reservations_follow_demand_even_when_held_below_it() {
        let mut c = ClusterQos::default();
        let q = MountQos {
            session: 1,
            reservation: 6000,
            limit: 0,
            weight: 1,
        };
        c.mounts.insert(0, q);
        // No demand yet: an even split.
        let p = c.place(&[node(0, &[]), node(1, &[])]);
        assert_eq!((share(&p, 0, 0), share(&p, 1, 0)), (3000, 3000));
        // Held back to 4000 on node 1 only: the whole reservation moves there.
        let p = c.place(&[node(0, &[]), node(1, &[(0, 4000)])]);
        assert_eq!((share(&p, 0, 0), share(&p, 1, 0)), (0, 6000));
        // Demand over both nodes, below the reservation: split in its proportions.
        let p = c.place(&[node(0, &[(0, 1000)]), node(1, &[(0, 3000)])]);
        assert_eq!((share(&p, 0, 0), share(&p, 1, 0)), (1500, 4500));
        // pShift off: always even.
        c.even_split = true;
        let p = c.place(&[node(0, &[]), node(1, &[(0, 4000)])]);
        assert_eq!((share(&p, 0, 0), share(&p, 1, 0)), (3000, 3000));
    }
}
