//! Prometheus text exposition, shared by memory nodes (`--metrics-listen`) and mounts
//! (`-o metrics=ADDR`): a [`Page`] that writes metric families in the text format (version
//! 0.0.4), a lock-free latency [`Histogram`], and [`serve`], a plain HTTP/1.0 endpoint that
//! answers every request with the current page.
//!
//! Invariant of a [`Histogram`]: `count` is the sum of the bucket counts, and every observation
//! falls in exactly one bucket (the last one is unbounded), so the cumulative `_bucket` series
//! rendered from it never decreases and its `+Inf` bucket equals `_count`.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in microseconds (the last bucket, +Inf, is implied).
pub const BUCKETS_US: [u64; 16] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 1_000_000,
    10_000_000,
];

/// A latency histogram: counts per bucket of [`BUCKETS_US`] and the sum, updated with relaxed
/// atomics (a scrape may see an observation's count before its sum; totals stay exact).
#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one latency.
    pub fn observe(&self, d: Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        let i = BUCKETS_US
            .iter()
            .position(|&le| us <= le)
            .unwrap_or(BUCKETS_US.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Cumulative counts per bucket bound (the last is +Inf), and the sum in seconds.
    fn snapshot(&self) -> (Vec<u64>, f64) {
        let mut acc = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect();
        (cumulative, self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// The text of one scrape, written family by family.
#[derive(Default)]
pub struct Page {
    text: String,
    family: String,
}

/// Labels as `name="value"` pairs; values are escaped as the format asks.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

fn labels(l: Labels, extra: Option<(&str, &str)>) -> String {
    let all: Vec<String> = l
        .iter()
        .copied()
        .chain(extra)
        .map(|(k, v)| {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect();
    if all.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", all.join(","))
    }
}

impl Page {
    pub fn new() -> Page {
        Page::default()
    }

    /// Starts family `rackfs_<name>` once (its HELP and TYPE lines).
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        if self.family != name {
            let _ = writeln!(
                self.text,
                "# HELP rackfs_{name} {help}\n# TYPE rackfs_{name} {kind}"
            );
            self.family = name.into();
        }
    }

    /// One sample of a counter (call again with the same name for more label sets).
    pub fn counter(&mut self, name: &str, help: &str, l: Labels, v: u64) {
        self.family(name, "counter", help);
        let _ = writeln!(self.text, "rackfs_{name}{} {v}", labels(l, None));
    }

    /// One sample of a gauge.
    pub fn gauge(&mut self, name: &str, help: &str, l: Labels, v: u64) {
        self.family(name, "gauge", help);
        let _ = writeln!(self.text, "rackfs_{name}{} {v}", labels(l, None));
    }

    /// A histogram's buckets (in seconds), sum and count.
    pub fn histogram(&mut self, name: &str, help: &str, l: Labels, h: &Histogram) {
        self.family(name, "histogram", help);
        let (cumulative, sum) = h.snapshot();
        for (i, c) in cumulative.iter().enumerate() {
            let le = BUCKETS_US
                .get(i)
                .map_or("+Inf".to_string(), |us| format!("{}", *us as f64 / 1e6));
            let _ = writeln!(
                self.text,
                "rackfs_{name}_bucket{} {c}",
                labels(l, Some(("le", &le)))
            );
        }
        let total = cumulative.last().copied().unwrap_or(0);
        let _ = writeln!(self.text, "rackfs_{name}_sum{} {sum}", labels(l, None));
        let _ = writeln!(self.text, "rackfs_{name}_count{} {total}", labels(l, None));
    }

    /// The exposition text.
    pub fn finish(self) -> String {
        self.text
    }
}

/// Answers every request on `listener` with `page()` until the process ends (plain HTTP/1.0,
/// one response per connection, any path; a client that sends nothing within 2 s still gets
/// the page).
pub fn serve(listener: TcpListener, page: impl Fn() -> String) {
    for conn in listener.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 2048];
        let _ = c.read(&mut buf);
        let body = page();
        let _ = write!(
            c,
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_renders_cumulative_buckets_ending_in_its_count() {
        let h = Histogram::default();
        for us in [1, 7, 7, 300, 20_000_000] {
            h.observe(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 5);
        let mut p = Page::new();
        p.histogram("op_seconds", "Latency.", &[("op", "read")], &h);
        let text = p.finish();
        assert!(
            text.starts_with(
                "# HELP rackfs_op_seconds Latency.\n# TYPE rackfs_op_seconds histogram\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_bucket{op=\"read\",le=\"0.000005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_bucket{op=\"read\",le=\"0.00001\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_bucket{op=\"read\",le=\"0.0005\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_bucket{op=\"read\",le=\"10\"} 4\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_bucket{op=\"read\",le=\"+Inf\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_count{op=\"read\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("rackfs_op_seconds_sum{op=\"read\"} 20.000315\n"),
            "{text}"
        );
    }

    #[test]
    fn a_family_is_introduced_once_and_labels_are_escaped() {
        let mut p = Page::new();
        p.counter("errors_total", "Errors.", &[("errno", "ENOENT")], 2);
        p.counter("errors_total", "Errors.", &[("errno", "a\"b\\c")], 1);
        p.gauge("up", "Up.", &[], 1);
        let text = p.finish();
        assert_eq!(
            text.matches("# TYPE rackfs_errors_total counter").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("rackfs_errors_total{errno=\"a\\\"b\\\\c\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("rackfs_up 1\n"), "{text}");
    }

    #[test]
    fn the_endpoint_answers_with_the_page() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l, || "rackfs_up 1\n".into()));
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        assert!(got.starts_with("HTTP/1.0 200 OK\r\n"), "{got}");
        assert!(got.ends_with("\r\n\r\nrackfs_up 1\n"), "{got}");
    }
}
