//! Haechi's experiments (2A, 2B, 2C, 4), reproduced with library-level clients on the
//! deterministic simulator: the real QoS engine and monitor, their tokens and reports on the
//! simulated transport's one-sided verbs, and a modelled NIC. The model is what the paper's
//! testbed has and this 2-core machine cannot: a data node that serves at most `C` IOPS in
//! FIFO order, and clients that each reach at most `C_L` IOPS (burst requests: every client
//! keeps 4 requests outstanding). Scale: C = 100k IOPS, C_L = 25k, 10 clients, T = 100 ms
//! (the paper: 1570k, 400k, 10 clients, 1 s), so ratios match the paper's (C / C_L ~ 4).
//! Runs are deterministic: the same command prints the same table.

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use rackfs_qos::{
    CapacityEstimator, EngineConfig, MonitorConfig, MountShare, QosEngine, QosMonitor,
};
use rackfs_verbs::sim::{Sim, SimConfig, SimHandle, SIM_RKEY};
use rackfs_verbs::RemoteAddr;

use crate::plot;

pub const CAPACITY: u64 = 100_000;
pub const CLIENT_CAPACITY: u64 = 25_000;
pub const PERIOD: Duration = Duration::from_millis(100);
const OUTSTANDING: usize = 4;

/// The modelled NIC: FIFO service at `C` IOPS (less what background load takes).
struct Nic {
    free_at: Cell<Duration>,
    per_op: Cell<Duration>,
}

impl Nic {
    /// Serves one I/O that is ready at `ready`; returns when it completes.
    fn serve(&self, ready: Duration) -> Duration {
        let start = ready.max(self.free_at.get());
        let done = start + self.per_op.get();
        self.free_at.set(done);
        done
    }
}

#[derive(Clone, Debug)]
pub struct Experiment {
    pub reservations: Vec<u64>,
    /// Per client (empty: all 1).
    pub weights: Vec<u32>,
    /// The node's profiled capacity, IOPS (`None`: the NIC's), and whether the estimate
    /// adapts from it (else it stays fixed, as a capacity set by hand).
    pub profiled: Option<u64>,
    pub adaptive: bool,
    /// Per client: tokens per period it asks for (None: backlogged).
    pub demand: Vec<Option<u64>>,
    pub qos: bool,
    pub conversion: bool,
    pub periods: u32,
    /// (from period, background IOPS on the NIC outside QoS).
    pub background: Vec<(u32, u64)>,
}

impl Experiment {
    /// Every client backlogged, QoS with conversion, the NIC's capacity as profiled.
    pub fn backlogged(reservations: Vec<u64>, periods: u32) -> Experiment {
        Experiment {
            demand: vec![None; reservations.len()],
            reservations,
            weights: Vec::new(),
            profiled: None,
            adaptive: true,
            qos: true,
            conversion: true,
            periods,
            background: Vec::new(),
        }
    }
}

/// Per client, per period: I/Os completed. And per period: the monitor's capacity estimate.
pub struct Outcome {
    pub done: Vec<Vec<u64>>,
    pub capacity: Vec<u64>,
    /// Per period: tokens added to the pool by conversion.
    pub converted: Vec<u64>,
}

fn wait_until(h: &SimHandle, t: Duration) -> impl std::future::Future<Output = ()> + '_ {
    let now = h.now();
    h.clock_sleep(t.saturating_sub(now))
}

pub fn run(e: &Experiment) -> Outcome {
    let mut sim = Sim::new(SimConfig {
        seed: 7,
        region_len: 1 << 20,
        ..SimConfig::default()
    });
    let h = sim.handle();
    let region = h.region();
    let profiled = per_period(e.profiled.unwrap_or(CAPACITY));
    let monitor = Rc::new(RefCell::new(QosMonitor::new(
        &region,
        0,
        MonitorConfig {
            period: PERIOD,
            check: Duration::from_millis(1),
            conversion: e.conversion,
        },
        if e.adaptive {
            CapacityEstimator::new(profiled, profiled / 10, profiled / 50, 8)
        } else {
            CapacityEstimator::new(profiled, 0, 0, 8)
        },
        h.now(),
    )));
    for (c, &r) in e.reservations.iter().enumerate() {
        monitor.borrow_mut().set_mount(
            c as u16,
            Some(MountShare {
                reservation: per_period(r),
                limit: 0,
                weight: e.weights.get(c).copied().unwrap_or(1),
            }),
        );
    }
    let end = PERIOD * (e.periods + 1);
    let nic = Rc::new(Nic {
        free_at: Cell::new(Duration::ZERO),
        per_op: Cell::new(Duration::from_nanos(1_000_000_000 / CAPACITY)),
    });
    let n = e.reservations.len();
    let done: Rc<RefCell<Vec<Vec<u64>>>> =
        Rc::new(RefCell::new(vec![vec![0; e.periods as usize + 2]; n]));
    let capacity = Rc::new(RefCell::new(Vec::new()));
    // The memory node's monitor.
    let node = sim.add_client();
    {
        let (h, m, region, capacity) =
            (h.clone(), monitor.clone(), region.clone(), capacity.clone());
        sim.spawn(node, async move {
            while h.now() < end {
                h.clock_sleep(Duration::from_millis(1)).await;
                let before = m.borrow().period();
                m.borrow_mut().tick(&region, h.now());
                if m.borrow().period() != before {
                    capacity.borrow_mut().push(m.borrow().capacity());
                }
            }
        });
    }
    // Background load outside QoS: it takes NIC time at the given rate.
    if !e.background.is_empty() {
        let id = sim.add_client();
        let (h, nic, bg) = (h.clone(), nic.clone(), e.background.clone());
        sim.spawn(id, async move {
            while h.now() < end {
                let p = (h.now().as_nanos() / PERIOD.as_nanos()) as u32;
                let rate = bg
                    .iter()
                    .rev()
                    .find(|(from, _)| p >= *from)
                    .map_or(0, |b| b.1);
                if rate == 0 {
                    h.clock_sleep(Duration::from_millis(1)).await;
                    continue;
                }
                // Open loop: the load takes NIC time at its rate, whatever the queue.
                nic.serve(h.now());
                h.clock_sleep(Duration::from_nanos(1_000_000_000 / rate))
                    .await;
            }
        });
    }
    let engines = Rc::new(RefCell::new(Vec::new()));
    for c in 0..n {
        let id = sim.add_client();
        let engine = Rc::new(QosEngine::new(
            h.connect(id),
            RemoteAddr::new(SIM_RKEY, 0),
            c as u16,
            EngineConfig::default(),
        ));
        engines.borrow_mut().push(engine.clone());
        if e.qos {
            // The mount's background refresh: keeps an idle engine's reports current.
            let (h, engine) = (h.clone(), engine.clone());
            sim.spawn(id, async move {
                while h.now() < end {
                    h.clock_sleep(Duration::from_millis(1)).await;
                    engine.tick().await.expect("tick");
                }
            });
        }
        let client_free = Rc::new(Cell::new(Duration::ZERO));
        let asked = Rc::new(Cell::new((0u32, 0u64)));
        for _ in 0..OUTSTANDING {
            let (h, engine, nic, done, client_free, asked) = (
                h.clone(),
                engine.clone(),
                nic.clone(),
                done.clone(),
                client_free.clone(),
                asked.clone(),
            );
            let (qos, demand) = (e.qos, e.demand[c]);
            sim.spawn(id, async move {
                while h.now() < end {
                    let p = (h.now().as_nanos() / PERIOD.as_nanos()) as u32;
                    if let Some(d) = demand {
                        // A client with limited demand stops for the rest of the period.
                        let (ap, n) = asked.get();
                        let n = if ap == p { n } else { 0 };
                        if n >= d {
                            wait_until(&h, PERIOD * (p + 1)).await;
                            continue;
                        }
                        asked.set((p, n + 1));
                    }
                    let admitted = if qos {
                        Some(engine.admit(1).await.expect("admit"))
                    } else {
                        None
                    };
                    // The client's own rate limit, then the NIC.
                    let ready = h.now().max(client_free.get())
                        + Duration::from_nanos(1_000_000_000 / CLIENT_CAPACITY);
                    client_free.set(ready);
                    let t = nic.serve(ready);
                    wait_until(&h, t).await;
                    let p = (h.now().as_nanos() / PERIOD.as_nanos()) as usize;
                    if let Some(v) = done.borrow_mut()[c].get_mut(p) {
                        *v += 1;
                    }
                    drop(admitted);
                }
            });
        }
    }
    sim.run(end + PERIOD * 4);
    let done = done.borrow().clone();
    let capacity = capacity.borrow().clone();
    let converted = monitor
        .borrow()
        .history
        .iter()
        .map(|r| r.converted)
        .collect();
    Outcome {
        done,
        capacity,
        converted,
    }
}

/// Reservations of 10 clients summing to `fraction` of capacity: uniform, or Zipf(0.6) over 5
/// groups of two (the paper's Zipf setup).
pub fn reservations(zipf: bool, fraction: f64) -> Vec<u64> {
    let total = CAPACITY as f64 * fraction;
    if !zipf {
        return vec![(total / 10.0) as u64; 10];
    }
    let w: Vec<f64> = (1..=5).map(|k| 1.0 / (k as f64).powf(0.6)).collect();
    let sum: f64 = w.iter().sum::<f64>() * 2.0;
    w.iter()
        .flat_map(|x| {
            let r = (total * x / sum) as u64;
            [r, r]
        })
        .collect()
}

/// Periods after the first (warm-up) and before the last (cut short).
fn steady(v: &[u64], periods: u32) -> &[u64] {
    &v[2..=periods as usize]
}

/// Tokens per period of `iops`.
fn per_period(iops: u64) -> u64 {
    iops * PERIOD.as_millis() as u64 / 1000
}

fn iops(ops: u64) -> u64 {
    ops * 1000 / PERIOD.as_millis() as u64
}

/// Experiment 2A: every client backlogged, 90% reserved; with and without QoS.
/// Per client: reservation, and I/Os per period with and without QoS.
pub type ClientSeries = (u64, Vec<u64>, Vec<u64>);

pub fn exp_2a(zipf: bool, periods: u32) -> (String, Vec<ClientSeries>) {
    let res = reservations(zipf, 0.9);
    let base = Experiment::backlogged(res.clone(), periods);
    let with = run(&base);
    let without = run(&Experiment {
        qos: false,
        ..base.clone()
    });
    let mut md = "| client | reservation IOPS | Haechi: mean IOPS | periods meeting R | no QoS: mean IOPS | periods meeting R |\n|---:|---:|---:|---:|---:|---:|\n".to_string();
    let mut rows = Vec::new();
    let (mut tot_q, mut tot_b) = (0, 0);
    for (c, &r) in res.iter().enumerate() {
        let q = steady(&with.done[c], periods).to_vec();
        let b = steady(&without.done[c], periods).to_vec();
        let met = |v: &[u64]| v.iter().filter(|&&x| x >= per_period(r)).count();
        let mean = |v: &[u64]| iops(v.iter().sum::<u64>() / v.len() as u64);
        tot_q += mean(&q);
        tot_b += mean(&b);
        md.push_str(&format!(
            "| C{} | {} | {} | {}/{} | {} | {}/{} |\n",
            c + 1,
            r,
            mean(&q),
            met(&q),
            q.len(),
            mean(&b),
            met(&b),
            b.len()
        ));
        rows.push((r, q, b));
    }
    md.push_str(&format!(
        "| all | {} | {tot_q} | | {tot_b} | |\n",
        res.iter().sum::<u64>()
    ));
    (md, rows)
}

/// Experiment 2B: clients C1 and C2 ask for half their reservation each period; token
/// conversion on (Haechi) vs off (basic Haechi).
/// 2B; with `plots`, also a bar chart there.
pub fn exp_2b(zipf: bool, periods: u32, plots: Option<&Path>) -> String {
    let res = reservations(zipf, 0.9);
    let mut demand = vec![None; 10];
    for (c, d) in demand.iter_mut().enumerate().take(2) {
        *d = Some(res[c] * PERIOD.as_millis() as u64 / 1000 / 2);
    }
    let base = Experiment {
        demand,
        ..Experiment::backlogged(res.clone(), periods)
    };
    let with = run(&base);
    let basic = run(&Experiment {
        conversion: false,
        ..base.clone()
    });
    let bare = run(&Experiment { qos: false, ..base });
    let total = |o: &Outcome, from: usize| -> u64 {
        (from..10)
            .map(|c| iops(steady(&o.done[c], periods).iter().sum::<u64>() / (periods as u64 - 1)))
            .sum()
    };
    let row = |name: &str, o: &Outcome| {
        let conv = o.converted.iter().skip(2).sum::<u64>()
            / o.converted.len().saturating_sub(2).max(1) as u64;
        format!(
            "| {name} | {} | {} | {} | {} |\n",
            total(o, 2),
            total(o, 0),
            o.capacity.last().map_or(0, |&c| iops(c)),
            iops(conv)
        )
    };
    let mut md = format!(
        "| system | C3-C10 IOPS | all clients IOPS | last capacity estimate IOPS | converted IOPS |\n|---|---:|---:|---:|---:|\n{}{}{}",
        row("Haechi (conversion)", &with),
        row("basic Haechi (no conversion)", &basic),
        row("no QoS", &bare)
    );
    if let Some(dir) = plots {
        let name = if zipf { "zipf" } else { "uniform" };
        let svg = plot::bars(
            &format!("2B ({name}): C1, C2 ask for half their reservation"),
            "IOPS",
            &[
                "Haechi".to_string(),
                "no conversion".to_string(),
                "no QoS".to_string(),
            ],
            &[
                (
                    "C3-C10",
                    vec![total(&with, 2), total(&basic, 2), total(&bare, 2)]
                        .into_iter()
                        .map(|x| x as f64)
                        .collect(),
                ),
                (
                    "all clients",
                    vec![total(&with, 0), total(&basic, 0), total(&bare, 0)]
                        .into_iter()
                        .map(|x| x as f64)
                        .collect(),
                ),
            ],
        );
        let f = plot::save(dir, &format!("qos-2b-{name}"), &svg);
        md.push_str(&format!("\n![2B {name}]({f})\n"));
    }
    md
}

/// Experiment 2C: 50% to 90% of capacity reserved; throughput and whether all met R.
/// 2C; with `plots`, also a bar chart there.
pub fn exp_2c(periods: u32, plots: Option<&Path>) -> String {
    let mut met_share: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut md = "| reserved | distribution | throughput IOPS | client-periods meeting R |\n|---:|---|---:|---:|\n".to_string();
    for pct in [50, 60, 70, 80, 90] {
        for zipf in [false, true] {
            let res = reservations(zipf, pct as f64 / 100.0);
            let o = run(&Experiment::backlogged(res.clone(), periods));
            let thr: u64 = (0..10)
                .map(|c| {
                    iops(steady(&o.done[c], periods).iter().sum::<u64>() / (periods as u64 - 1))
                })
                .sum();
            let (met, all) = (0..10).fold((0, 0), |(m, a), c| {
                let v = steady(&o.done[c], periods);
                (
                    m + v.iter().filter(|&&x| iops(x) >= res[c]).count(),
                    a + v.len(),
                )
            });
            md.push_str(&format!(
                "| {pct}% | {} | {thr} | {met}/{all} |\n",
                if zipf { "Zipf 0.6" } else { "uniform" }
            ));
            met_share[zipf as usize].push(100.0 * met as f64 / all.max(1) as f64);
        }
    }
    if let Some(dir) = plots {
        let svg = plot::bars(
            "2C: client-periods meeting their reservation",
            "%",
            &["50%", "60%", "70%", "80%", "90%"].map(String::from),
            &[
                ("uniform", met_share[0].clone()),
                ("Zipf(0.6)", met_share[1].clone()),
            ],
        );
        let f = plot::save(dir, "qos-2c", &svg);
        md.push_str(&format!("\n![2C]({f})\n"));
    }
    md
}

/// Experiment 4: background load outside QoS takes 25% of the NIC from the middle of the run
/// (capacity overestimated), or stops there (underestimated). Per period: capacity estimate,
/// total IOPS, and the highest-reservation client against its reservation.
pub fn exp_4(drop: bool, periods: u32) -> (String, Vec<(u64, u64, u64, u64)>) {
    let res = reservations(true, 0.8);
    let half = periods / 2;
    let bg = CAPACITY / 4;
    let background = if drop {
        vec![(half, bg)]
    } else {
        vec![(0, bg), (half, 0)]
    };
    let o = run(&Experiment {
        background,
        ..Experiment::backlogged(res.clone(), periods)
    });
    let mut md = format!(
        "| period | capacity estimate IOPS | QoS clients IOPS | C1 IOPS (R = {}) |\n|---:|---:|---:|---:|\n",
        res[0]
    );
    let mut series = Vec::new();
    for p in 1..=periods as usize {
        let total: u64 = (0..10).map(|c| iops(o.done[c][p])).sum();
        let cap = o.capacity.get(p - 1).map_or(0, |&c| iops(c));
        md.push_str(&format!(
            "| {p} | {cap} | {total} | {} |\n",
            iops(o.done[0][p])
        ));
        series.push((p as u64, cap, total, iops(o.done[0][p])));
    }
    (md, series)
}

/// Weights: three backlogged clients with no reservation and weights 1:2:3 share a node whose
/// capacity is set (fixed) to 36k IOPS while 55k IOPS of background load outside QoS leaves 45k
/// of the NIC: the tokens, not the NIC, are the binding constraint, and no client is held back
/// by its own 25k ceiling. (With an adaptive estimate the tokens track the NIC and a FIFO NIC
/// shares it equally whatever the weights.) Returns a table of mean IOPS and shares.
/// Weights 1:2:3; with `plots`, also a bar chart there.
pub fn exp_weights(periods: u32, plots: Option<&Path>) -> String {
    let e = Experiment {
        weights: vec![1, 2, 3],
        profiled: Some(36_000),
        adaptive: false,
        background: vec![(0, 55_000)],
        ..Experiment::backlogged(vec![0; 3], periods)
    };
    let o = run(&e);
    let means: Vec<u64> = (0..3)
        .map(|c| iops(steady(&o.done[c], periods).iter().sum::<u64>() / (periods as u64 - 1)))
        .collect();
    let total: u64 = means.iter().sum();
    let mut md = "| client | weight | mean IOPS | share of the three | weight's share |\n|---|---:|---:|---:|---:|\n".to_string();
    for (c, m) in means.iter().enumerate() {
        md.push_str(&format!(
            "| C{} | {} | {m} | {:.1}% | {:.1}% |\n",
            c + 1,
            c + 1,
            100.0 * *m as f64 / total.max(1) as f64,
            100.0 * (c + 1) as f64 / 6.0
        ));
    }
    if let Some(dir) = plots {
        let svg = plot::bars(
            "Weights 1:2:3 (simulated NIC): share of the spare capacity",
            "%",
            &["C1 (w=1)", "C2 (w=2)", "C3 (w=3)"].map(String::from),
            &[
                (
                    "measured",
                    means
                        .iter()
                        .map(|&m| 100.0 * m as f64 / total.max(1) as f64)
                        .collect(),
                ),
                (
                    "weight's share",
                    (1..=3).map(|w| 100.0 * w as f64 / 6.0).collect(),
                ),
            ],
        );
        let f = plot::save(dir, "qos-weights", &svg);
        md.push_str(&format!("\n![weights]({f})\n"));
    }
    md
}
