//! QoS on a memory node: the Haechi monitor on the node's own QoS area ([`NodeQos`]). The
//! monitor is the only writer of the area's period, pool and share words; mounts write their
//! report slots (see `rackfs_qos::area`). The primary's placement logic is
//! `rackfs_meta::placement`; the controller loop that runs it is the `qos_controller` module's
//! (above this one: it drives every node's monitor).

use std::time::Duration;

use rackfs_clock::{Mutex, SharedClock};
use rackfs_meta::placement::per_period;
use rackfs_proto::control::{QosNodeStatus, QosPeriod};
use rackfs_qos::monitor::PeriodRecord;
use rackfs_qos::{CapacityEstimator, MonitorConfig, MountShare, QosMonitor};
use rackfs_verbs::Region;

/// A node's QoS settings.
#[derive(Debug, Clone)]
pub struct QosConfig {
    pub period: Duration,
    pub check: Duration,
    /// The node's profiled capacity in IOPS (`None`: not profiled; [`ASSUMED_IOPS`] is used).
    pub capacity_iops: Option<u64>,
    /// The most one mount can do, IOPS (`None`: the node's capacity).
    pub client_iops: Option<u64>,
    /// Token conversion (off only for experiments).
    pub conversion: bool,
    /// pShift placement by demand; off (experiments only) splits every reservation evenly.
    pub pshift: bool,
}

/// Capacity assumed for a node that was not profiled.
pub const ASSUMED_IOPS: u64 = 1_000_000;

impl Default for QosConfig {
    fn default() -> Self {
        QosConfig {
            period: Duration::from_secs(1),
            check: Duration::from_millis(1),
            capacity_iops: None,
            client_iops: None,
            conversion: true,
            pshift: true,
        }
    }
}

/// One node's monitor and where its area is.
pub struct NodeQos {
    pub cfg: QosConfig,
    pub area: u64,
    /// The node's clock, and when the monitor started on it.
    clock: SharedClock,
    started: Duration,
    monitor: Mutex<QosMonitor>,
}

impl NodeQos {
    /// The monitor of the QoS area at `area` of `region`, timed on `clock` (the node's).
    pub fn new(cfg: QosConfig, region: &Region, area: u64, clock: SharedClock) -> NodeQos {
        let capacity = per_period(cfg.capacity_iops.unwrap_or(ASSUMED_IOPS), cfg.period);
        // History of 8 periods, growth step 1% of capacity, lower bound 3 sigma = 30%.
        let estimator = CapacityEstimator::new(capacity, capacity / 10, capacity / 100, 8);
        let monitor = QosMonitor::new(
            region,
            area,
            MonitorConfig {
                period: cfg.period,
                check: cfg.check,
                conversion: cfg.conversion,
            },
            estimator,
            Duration::ZERO,
        );
        NodeQos {
            cfg,
            area,
            started: clock.now(),
            clock,
            monitor: Mutex::new(monitor),
        }
    }

    /// One monitor pass (call every check interval).
    pub fn tick(&self, region: &Region) {
        self.monitor
            .lock()
            .expect("qos monitor")
            .tick(region, self.clock.now().saturating_sub(self.started));
    }

    /// Replaces the mounts' shares (from the next period on).
    pub fn set_shares(&self, shares: &[(u16, u64, u64, u32)]) {
        let mut m = self.monitor.lock().expect("qos monitor");
        let slots: Vec<u16> = m.mounts().keys().copied().collect();
        for s in slots {
            m.set_mount(s, None);
        }
        for &(slot, reservation, limit, weight) in shares {
            m.set_mount(
                slot,
                Some(MountShare {
                    reservation,
                    limit,
                    weight,
                }),
            );
        }
    }

    pub fn status(&self, node_id: u32) -> QosNodeStatus {
        let m = self.monitor.lock().expect("qos monitor");
        let convert = |r: &PeriodRecord| QosPeriod {
            period: r.period,
            capacity: r.capacity,
            pool_start: r.pool_start,
            converted: r.converted,
            mounts: r
                .mounts
                .iter()
                .map(|(&c, u)| (c, u.reservation, u.used, u.from_pool, u.demand))
                .collect(),
        };
        QosNodeStatus {
            node_id,
            period_ms: self.cfg.period.as_millis() as u64,
            capacity: m.capacity(),
            profiled: self.cfg.capacity_iops.is_some(),
            client_iops: self
                .cfg
                .client_iops
                .unwrap_or(self.cfg.capacity_iops.unwrap_or(ASSUMED_IOPS)),
            periods: m.history.iter().rev().take(16).rev().map(convert).collect(),
        }
    }
}
