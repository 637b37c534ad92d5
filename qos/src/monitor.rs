//! The memory node's QoS monitor (Haechi §II-E): periods, reservation grants, the global pool,
//! the signal to report, token conversion and capacity estimation. It works on the node's own
//! region with local atomics, the same words the engines reach with one-sided verbs
//! ([`crate::area`]); its CPU work is one short pass per check interval, never per I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use rackfs_verbs::{Region, VerbsError};
use tracing::warn;

use crate::area::{self, pack_pool, unpack_pair, unpack_pool};
use crate::estimate::CapacityEstimator;

/// A mount's QoS on this node: its reservation share and limit, in tokens per period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MountShare {
    pub reservation: u64,
    /// 0: no limit.
    pub limit: u64,
    /// Share of the global pool relative to other mounts that want it (0 counts as 1).
    pub weight: u32,
}

/// What the monitor saw of one mount in one period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MountPeriod {
    pub reservation: u64,
    /// Tokens used (from the mount's last report of the period).
    pub used: u64,
    /// Of those, from the global pool.
    pub from_pool: u64,
    /// Tokens the mount asked for (its demand), from its slot.
    pub demand: u64,
}

/// One finished period.
#[derive(Clone, Debug, Default)]
pub struct PeriodRecord {
    pub period: u64,
    /// Tokens the period started with (the capacity estimate).
    pub capacity: u64,
    pub pool_start: u64,
    /// Tokens added to the pool by conversion.
    pub converted: u64,
    pub mounts: BTreeMap<u16, MountPeriod>,
}

#[derive(Clone, Debug)]
pub struct MonitorConfig {
    pub period: Duration,
    pub check: Duration,
    /// Token conversion on (Haechi) or off ("basic Haechi", for experiments).
    pub conversion: bool,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            period: Duration::from_secs(1),
            check: Duration::from_millis(1),
            conversion: true,
        }
    }
}

#[derive(Clone, Copy, Default)]
struct Handed {
    given: u64,
    seen: i64,
    idle: u32,
    since_want: u32,
    /// Tokens the mount had spent at the last check (from its usage report).
    used: u64,
}

/// Checks a mount counts as wanting global tokens after it last showed it.
const WANT_MEMORY: u32 = 5;
/// Checks a share must sit untouched before it goes back to the pool (a mount that takes a
/// batch of tokens at a time may leave its share alone for several checks while busy).
const IDLE_SHARE: u32 = 20;

pub struct QosMonitor {
    area: u64,
    cfg: MonitorConfig,
    pub estimator: CapacityEstimator,
    mounts: BTreeMap<u16, MountShare>,
    /// Shares as granted at the start of the current period (changes apply at the next).
    granted: BTreeMap<u16, MountShare>,
    period: u64,
    started: Duration,
    capacity: u64,
    pool_start: u64,
    reporting: bool,
    converted: u64,
    /// Global tokens not yet handed out this period.
    pool: u64,
    /// Per slot: tokens handed out at the last check, the share seen, checks it sat
    /// untouched, and checks since the mount last wanted global tokens.
    handed: BTreeMap<u16, Handed>,
    /// The last periods, newest last (at most 64).
    pub history: Vec<PeriodRecord>,
}

impl QosMonitor {
    /// A monitor for the area at `area` of `region`, starting its first period at `now`.
    pub fn new(
        region: &Region,
        area: u64,
        cfg: MonitorConfig,
        estimator: CapacityEstimator,
        now: Duration,
    ) -> QosMonitor {
        let w = |off, v| region.store(area + off, v).expect("QoS area in region");
        w(area::PERIOD_US, cfg.period.as_micros() as u64);
        w(area::CHECK_US, cfg.check.as_micros() as u64);
        let mut m = QosMonitor {
            area,
            cfg,
            estimator,
            mounts: BTreeMap::new(),
            granted: BTreeMap::new(),
            period: 0,
            started: now,
            capacity: 0,
            pool_start: 0,
            reporting: false,
            converted: 0,
            pool: 0,
            handed: BTreeMap::new(),
            history: Vec::new(),
        };
        m.start_period(region, now);
        m
    }

    fn load(&self, region: &Region, off: u64) -> u64 {
        region.load(self.area + off).expect("QoS area in region")
    }
    fn store(&self, region: &Region, off: u64, v: u64) {
        region
            .store(self.area + off, v)
            .expect("QoS area in region")
    }

    /// A slot's report word for the current period; one written for another period (late, by
    /// an engine that had not yet seen this one start) reads as "nothing spent", with the
    /// whole reservation residual for `REPORT_WORD`.
    fn report(&self, region: &Region, c: u16, word: u64, s: &MountShare) -> (u64, u64, u64) {
        let (period, hi, lo) = unpack_pair(self.load(region, area::slot(c) + word));
        if period == self.period & 0xff {
            (period, hi, lo)
        } else if word == area::REPORT_WORD {
            (self.period, s.reservation, 0)
        } else {
            (self.period, 0, 0)
        }
    }

    pub fn mounts(&self) -> &BTreeMap<u16, MountShare> {
        &self.mounts
    }

    /// Reserved tokens per period over all mounts.
    pub fn reserved(&self) -> u64 {
        self.mounts.values().map(|m| m.reservation).sum()
    }

    /// The capacity (tokens per period) of the current period.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Sets (or with `None` removes) a mount's share; it takes effect at the next period.
    pub fn set_mount(&mut self, slot: u16, share: Option<MountShare>) {
        match share {
            Some(s) => {
                self.mounts.insert(slot, s);
            }
            None => {
                self.mounts.remove(&slot);
            }
        }
    }

    /// Runs the monitor at `now`: a new period when the current one is over, else a check.
    pub fn tick(&mut self, region: &Region, now: Duration) {
        if now >= self.started + self.cfg.period {
            self.start_period(region, now);
        } else {
            self.check(region, now);
        }
    }

    fn record(&self, region: &Region) -> PeriodRecord {
        let mounts = self
            .granted
            .iter()
            .map(|(&c, s)| {
                let (_, _, from_res) = self.report(region, c, area::REPORT_WORD, s);
                let (_, demand, used) = self.report(region, c, area::USAGE, s);
                (
                    c,
                    MountPeriod {
                        reservation: s.reservation,
                        used,
                        from_pool: used.saturating_sub(from_res),
                        demand,
                    },
                )
            })
            .collect();
        PeriodRecord {
            period: self.period,
            capacity: self.capacity,
            pool_start: self.pool_start,
            converted: self.converted,
            mounts,
        }
    }

    fn start_period(&mut self, region: &Region, now: Duration) {
        if self.period > 0 {
            let rec = self.record(region);
            // Estimation needs every mount's count: only periods with reports are measured.
            if self.reporting {
                let used: u64 = rec.mounts.values().map(|m| m.used).sum();
                // Reports are up to a few check intervals old: within that of the capacity,
                // every token was used.
                let lag = (self.capacity as u128 * 3 * self.cfg.check.as_nanos()
                    / self.cfg.period.as_nanos()) as u64;
                // Mounts that asked for more than they got were short of tokens, not of node
                // capacity: the period says nothing against the estimate (Algorithm 1 would
                // read it as a capacity drop and starve them further).
                let unserved: u64 = rec
                    .mounts
                    .values()
                    .map(|m| m.demand.saturating_sub(m.used))
                    .sum();
                let starved = unserved > lag;
                let used = if starved || used + lag >= self.capacity {
                    self.capacity
                } else {
                    used
                };
                self.estimator.end_period(used);
            }
            self.history.push(rec);
            if self.history.len() > 64 {
                self.history.remove(0);
            }
        }
        self.capacity = self.estimator.estimate();
        self.granted = self.mounts.clone();
        let reserved = self.reserved();
        self.pool_start = self.capacity.saturating_sub(reserved);
        for (&c, s) in &self.granted {
            self.store(region, area::slot(c) + area::GRANT, s.reservation);
            self.store(region, area::slot(c) + area::LIMIT, s.limit);
            self.store(region, area::slot(c) + area::REPORT_WORD, 0);
            self.store(region, area::slot(c) + area::USAGE, 0);
            // Mounts claim from the share with RDMA atomics: a store that is atomic with them
            // (through the NIC where the CPU's atomics are not; see `Region::store_shared`).
            let share = self.area + area::slot(c) + area::SHARE;
            if let Err(e) = region.store_shared(share, pack_pool(self.period + 1, 0)) {
                // The share keeps the last period's tag: claims get none of its tokens.
                warn!(slot = c, error = %e, "resetting a QoS share failed");
            }
            self.store(region, area::slot(c) + area::WEIGHT, s.weight.max(1) as u64);
        }
        self.pool = self.pool_start;
        self.handed.clear();
        self.store(
            region,
            area::POOL,
            pack_pool(self.period + 1, self.pool_start as i64),
        );
        self.store(region, area::REPORT, 0);
        self.store(region, area::ELAPSED_US, 0);
        self.reporting = false;
        self.converted = 0;
        self.started = now;
        self.period += 1;
        self.store(region, area::PERIOD, self.period);
    }

    fn check(&mut self, region: &Region, now: Duration) {
        let elapsed = now - self.started;
        self.store(region, area::ELAPSED_US, elapsed.as_micros() as u64);
        let tag = self.period & 0xffff;
        // Which mounts want global tokens: a negative share (a claim found it empty), or a
        // share handed out last check and all taken, now or in the last few checks. Shares
        // left untouched for IDLE_SHARE checks come back to the pool.
        let mut wanting: Vec<(u16, u32)> = Vec::new();
        for (&c, m) in &self.granted {
            let at = area::slot(c) + area::SHARE;
            let w = self.load(region, at);
            let (t, share) = unpack_pool(w);
            let share = if t == tag { share } else { 0 };
            let mut h = self.handed.get(&c).copied().unwrap_or(Handed {
                since_want: WANT_MEMORY,
                ..Handed::default()
            });
            // A mount that spent tokens since the last check is busy: it keeps its place among
            // those sharing the pool even while its share lasts (a mount held back by the node
            // rather than by tokens still counts).
            let (_, _, used) = self.report(region, c, area::USAGE, m);
            let busy = used > h.used;
            h.used = used;
            if share < 0 || (share == 0 && h.given > 0) || (busy && h.since_want < WANT_MEMORY) {
                h.since_want = 0;
                h.idle = 0;
            } else {
                h.since_want = h.since_want.saturating_add(1);
                h.idle = if share > 0 && share == h.seen {
                    h.idle + 1
                } else {
                    0
                };
                if h.idle >= IDLE_SHARE
                    && Self::swap_share(region, self.area + at, w, tag, 0).unwrap_or(false)
                {
                    self.pool += share as u64;
                    h.idle = 0;
                }
            }
            h.seen = share;
            h.given = 0;
            if h.since_want < WANT_MEMORY {
                wanting.push((c, m.weight.max(1)));
            }
            self.handed.insert(c, h);
        }
        if !self.reporting && !wanting.is_empty() {
            // Global tokens are wanted: ask every mount to report, for conversion.
            self.reporting = true;
            self.store(region, area::REPORT, 1);
        }
        if self.reporting && self.cfg.conversion {
            self.pool += self.convert(region);
        }
        // Hand out the pool, paced over the period's rest (twice the even rate), to the
        // mounts that want it in proportion to their weights.
        if self.pool > 0 && !wanting.is_empty() {
            let left = self.cfg.period.saturating_sub(elapsed);
            let budget = if left <= self.cfg.check * 2 {
                self.pool
            } else {
                ((self.pool as u128 * 2 * self.cfg.check.as_nanos() / left.as_nanos()) as u64)
                    .max(wanting.len() as u64)
                    .min(self.pool)
            };
            let total: u64 = wanting.iter().map(|w| w.1 as u64).sum();
            for &(c, weight) in &wanting {
                let give = (budget * weight as u64 / total).min(self.pool);
                // A mount holding four times its handout unspent gets no more for now.
                let held = self.handed.get(&c).map_or(0, |h| h.seen.max(0) as u64);
                if give == 0 || held > give * 4 {
                    continue;
                }
                let at = self.area + area::slot(c) + area::SHARE;
                // Engines claim concurrently: CAS until the share is replaced. Their failed
                // claims (a negative count) got nothing and are forgotten.
                let mut w = region.load(at).expect("QoS area in region");
                let given = loop {
                    let (t, share) = unpack_pool(w);
                    let base = if t == tag { share.max(0) } else { 0 };
                    match Self::swap_share(region, at, w, tag, base + give as i64) {
                        Ok(true) => break true,
                        Ok(false) => w = region.load(at).expect("QoS area in region"),
                        Err(_) => break false,
                    }
                };
                if !given {
                    continue;
                }
                self.pool -= give;
                if let Some(h) = self.handed.get_mut(&c) {
                    h.given = give;
                }
            }
        }
        self.store(region, area::POOL, pack_pool(tag, self.pool as i64));
    }

    /// Replaces share word `w` at `at` by `tokens` of period `tag`; false if it changed. The
    /// CAS is atomic with the mounts' claims, through the NIC if need be
    /// ([`Region::compare_swap`]); if that fails (the loopback queue pair broke: logged), the
    /// share is left to the next check. A CAS that failed may still have happened: then the
    /// mount got tokens the pool still counts, once.
    fn swap_share(
        region: &Region,
        at: u64,
        w: u64,
        tag: u64,
        tokens: i64,
    ) -> Result<bool, VerbsError> {
        match region.compare_swap(at, w, pack_pool(tag, tokens)) {
            Ok(old) => Ok(old == w),
            Err(e) => {
                warn!(offset = at, error = %e, "updating a QoS share failed");
                Err(e)
            }
        }
    }

    /// Conversion: reservation a mount can no longer use goes to the pool. A mount's
    /// outstanding reservation is what its last report of this period says (engines decay
    /// it for the time their mount asked for nothing, and report every δ once asked, idle or
    /// not); what it neither spent nor can still spend is added to the pool, once. A mount
    /// without a report of this period may be stalled with its whole reservation in hand:
    /// none of its reservation is converted. So the tokens of a period never exceed its
    /// capacity (up to a few δ of decay in flight). Returns the tokens added.
    fn convert(&mut self, region: &Region) -> u64 {
        let decayed: u64 = self
            .granted
            .iter()
            .map(|(&c, s)| {
                let (_, residual, spent) = self.report(region, c, area::REPORT_WORD, s);
                s.reservation.saturating_sub(residual).saturating_sub(spent)
            })
            .sum();
        let add = decayed.saturating_sub(self.converted);
        self.converted += add;
        add
    }

    /// The period in progress.
    pub fn period(&self) -> u64 {
        self.period
    }
}
