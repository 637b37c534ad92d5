//! Mount options: what `-o` accepts, with a clear error for anything else.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use rackfs_proto::size::{parse_size, SizeError};

/// Which transport a mount uses to reach memory nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// shm where the node's socket is on this host, tcp elsewhere.
    Auto,
    Shm,
    Tcp,
    /// RC queue pairs on an RDMA device (a build with the `rdma` feature).
    Rdma,
}

/// Client-side data caching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    /// Direct I/O: every read and write goes to the memory nodes; other mounts see a write as
    /// soon as `write()` returns.
    None,
    /// The kernel page cache keeps data between opens (`keep_cache`) and writes back lazily:
    /// fast for one writer, but other mounts may see stale data. Single-writer workloads only.
    Writeback,
}

/// Which replica of a stripe a read goes to (RackOut's static and adaptive balancing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPolicy {
    /// A hash of the file and stripe: each stripe is always read from the same replica.
    Static,
    /// The replica whose node looks least busy to this mount: fewest operations outstanding,
    /// weighted by its recent latency.
    Adaptive,
}

/// Everything `-o` can set.
#[derive(Clone, Debug, PartialEq)]
pub struct MountOptions {
    pub secret_file: PathBuf,
    pub transport: TransportChoice,
    /// The RDMA device for `transport=rdma` (`None`: the first one).
    pub rdma_device: Option<String>,
    pub cache: CacheMode,
    /// Stripe unit of files this mount creates.
    pub stripe_unit: u64,
    /// Copies of every stripe of files this mount creates (0: the cluster's default).
    pub replicas: u32,
    /// Which replica of a stripe a read goes to.
    pub read_policy: ReadPolicy,
    pub threads: usize,
    pub allow_other: bool,
    pub read_only: bool,
    /// How long the kernel may cache attributes and names.
    pub attr_timeout: Duration,
    /// How long a control RPC to a memory node may take before the operation fails with EIO.
    pub timeout: Duration,
    /// Writes and truncates take Citron range locks (`locks=off`: only for a single writer
    /// per file, or to measure what locking costs).
    pub locks: bool,
    /// With locks, a mount writing a file uncontended keeps the file's whole lock tree between
    /// writes, giving it back when another mount waits (`keep_locks=off`: a lock per write).
    pub keep_locks: bool,
    /// Files whose opens the mount keeps past their last close, to open them again without a
    /// round trip (`kept_opens=0`: every last close gives the open back; see `crate::kept`).
    pub kept_opens: usize,
    /// Haechi QoS: every data operation spends tokens (`qos=off`: unaccounted, for
    /// measuring QoS's own cost).
    pub qos: bool,
    /// Reserved IOPS (4 KiB one-sided operations per second; 0: none).
    pub reservation: u64,
    /// IOPS limit (0: none).
    pub limit: u64,
    /// Share of spare capacity relative to other mounts.
    pub weight: u32,
    /// Where the mount serves its Prometheus text metrics (`None`: nowhere).
    pub metrics: Option<SocketAddr>,
    /// How long a control RPC's caller polls for the answer before it sleeps.
    pub poll: Duration,
    /// Options accepted for compatibility with mount(8)/fstab and ignored.
    pub ignored: Vec<String>,
}

/// The longest `poll_us` (a poller longer than a round trip only burns a CPU).
const MAX_POLL_US: u64 = 10_000;

/// Most `kept_opens=`.
const MAX_KEPT_OPENS: usize = 1_000_000;

pub const DEFAULT_SECRET_FILE: &str = "/etc/rackfs/secret";

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            secret_file: PathBuf::from(DEFAULT_SECRET_FILE),
            transport: TransportChoice::Auto,
            rdma_device: None,
            cache: CacheMode::None,
            stripe_unit: rackfs_proto::namespace::DEFAULT_STRIPE_UNIT,
            replicas: 0,
            read_policy: ReadPolicy::Adaptive,
            threads: 4,
            allow_other: false,
            read_only: false,
            attr_timeout: Duration::from_secs(1),
            timeout: rackfs_proto::client::RPC_DEADLINE,
            locks: true,
            keep_locks: true,
            kept_opens: crate::kept::DEFAULT_CAP,
            qos: true,
            reservation: 0,
            limit: 0,
            weight: 1,
            metrics: None,
            poll: rackfs_verbs::poll::CONTROL_POLL,
            ignored: Vec::new(),
        }
    }
}

/// Options mount(8) and fstab pass that mean nothing to RackFS.
const IGNORED: &[&str] = &[
    "_netdev",
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "rw",
    "nofail",
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "atime",
    "noatime",
    "relatime",
    "default_permissions",
    "async",
];

/// IOPS as a whole number with an optional `k` (1000) or `M` (10^6) suffix.
pub fn parse_iops(v: &str) -> Option<u64> {
    let (num, mult) = match v.strip_suffix(['k', 'K']) {
        Some(n) => (n, 1_000),
        None => match v.strip_suffix('M') {
            Some(n) => (n, 1_000_000),
            None => (v, 1),
        },
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

/// Why a mount option string was refused; the message names the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error("mount option {0} needs a value ({0}=...)")]
    NeedsValue(String),
    #[error("{key}={value}: expected {expected}")]
    BadValue {
        key: String,
        value: String,
        expected: &'static str,
    },
    #[error("stripe_unit: {0}")]
    StripeUnit(#[from] SizeError),
    #[error("unknown mount option {0:?}")]
    Unknown(String),
    #[error("limit={limit} is below reservation={reservation}: a limit must be at least the reservation")]
    LimitBelowReservation { limit: u64, reservation: u64 },
    #[error("reservation= and limit= need qos=on")]
    QosOff,
}

/// A duration in (decimal) seconds from `min` to an hour.
fn seconds(key: &str, v: &str, min: f64, expected: &'static str) -> Result<Duration, OptionsError> {
    v.parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && (min..=3600.0).contains(s))
        .map(Duration::from_secs_f64)
        .ok_or_else(|| bad(key, v, expected))
}

fn on_off(key: &str, v: &str) -> Result<bool, OptionsError> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        v => Err(bad(key, v, "on or off")),
    }
}

fn bad(key: &str, value: impl ToString, expected: &'static str) -> OptionsError {
    OptionsError::BadValue {
        key: key.into(),
        value: value.to_string(),
        expected,
    }
}

impl MountOptions {
    /// Limits must leave room for the reservation.
    pub fn check_qos(&self) -> Result<(), OptionsError> {
        if self.limit > 0 && self.limit < self.reservation {
            return Err(OptionsError::LimitBelowReservation {
                limit: self.limit,
                reservation: self.reservation,
            });
        }
        if !self.qos && (self.reservation > 0 || self.limit > 0) {
            return Err(OptionsError::QosOff);
        }
        Ok(())
    }

    /// Parses a comma-separated option string (`-o` syntax). Repeated options: the last wins.
    pub fn parse(s: &str) -> Result<MountOptions, OptionsError> {
        let mut o = MountOptions::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            fn need<'v>(key: &str, v: Option<&'v str>) -> Result<&'v str, OptionsError> {
                v.filter(|v| !v.is_empty())
                    .ok_or_else(|| OptionsError::NeedsValue(key.into()))
            }
            match key {
                "secret_file" => o.secret_file = PathBuf::from(need(key, value)?),
                "transport" => {
                    o.transport = match need(key, value)? {
                        "auto" => TransportChoice::Auto,
                        "shm" => TransportChoice::Shm,
                        "tcp" => TransportChoice::Tcp,
                        "rdma" => TransportChoice::Rdma,
                        v => return Err(bad(key, v, "auto, shm, tcp or rdma")),
                    }
                }
                "rdma_device" => o.rdma_device = Some(need(key, value)?.to_string()),
                "cache" => {
                    o.cache = match need(key, value)? {
                        "none" => CacheMode::None,
                        "writeback" => CacheMode::Writeback,
                        v => return Err(bad(key, v, "none or writeback")),
                    }
                }
                "stripe_unit" => {
                    let v = parse_size(need(key, value)?)?;
                    if v == 0 || !v.is_multiple_of(4096) || v > 64 << 20 {
                        return Err(bad(key, v, "a multiple of 4K up to 64M"));
                    }
                    o.stripe_unit = v;
                }
                "replicas" => {
                    let v = need(key, value)?;
                    o.replicas = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=rackfs_proto::record::MAX_REPLICAS).contains(n))
                        .ok_or_else(|| bad(key, v, "a number from 1 to 4"))?;
                }
                "read_policy" => {
                    o.read_policy = match need(key, value)? {
                        "adaptive" => ReadPolicy::Adaptive,
                        "static" => ReadPolicy::Static,
                        v => return Err(bad(key, v, "adaptive or static")),
                    }
                }
                "threads" => {
                    let v = need(key, value)?;
                    o.threads = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=64).contains(n))
                        .ok_or_else(|| bad(key, v, "a number from 1 to 64"))?;
                }
                "poll_us" => {
                    let v = need(key, value)?;
                    o.poll = v
                        .parse()
                        .ok()
                        .filter(|n| *n <= MAX_POLL_US)
                        .map(Duration::from_micros)
                        .ok_or_else(|| bad(key, v, "microseconds from 0 to 10000"))?;
                }
                "attr_timeout" => {
                    o.attr_timeout = seconds(key, need(key, value)?, 0.0, "seconds from 0 to 3600")?
                }
                "timeout" => {
                    o.timeout = seconds(key, need(key, value)?, 0.1, "seconds from 0.1 to 3600")?
                }
                "locks" => o.locks = on_off(key, need(key, value)?)?,
                "keep_locks" => o.keep_locks = on_off(key, need(key, value)?)?,
                "kept_opens" => {
                    let v = need(key, value)?;
                    o.kept_opens = v
                        .parse()
                        .ok()
                        .filter(|n| *n <= MAX_KEPT_OPENS)
                        .ok_or_else(|| bad(key, v, "a number of files from 0 to 1000000"))?;
                }
                "allow_other" if value.is_none() => o.allow_other = true,
                "ro" if value.is_none() => o.read_only = true,
                k if IGNORED.contains(&k) && value.is_none() => o.ignored.push(k.to_string()),
                "qos" => o.qos = on_off(key, need(key, value)?)?,
                "reservation" | "limit" => {
                    let v = need(key, value)?;
                    let n = parse_iops(v).ok_or_else(|| {
                        bad(
                            key,
                            v,
                            "IOPS, a whole number with an optional k or M suffix",
                        )
                    })?;
                    if key == "reservation" {
                        o.reservation = n;
                    } else {
                        o.limit = n;
                    }
                }
                "metrics" => {
                    let v = need(key, value)?;
                    let local = v
                        .strip_prefix("localhost:")
                        .map(|p| format!("127.0.0.1:{p}"));
                    o.metrics = Some(local.as_deref().unwrap_or(v).parse().map_err(|_| {
                        bad(
                            key,
                            v,
                            "HOST:PORT with an IP address (or localhost), e.g. 127.0.0.1:9101",
                        )
                    })?);
                }
                "weight" => {
                    let v = need(key, value)?;
                    o.weight = v
                        .parse()
                        .ok()
                        .filter(|w| (1..=10_000).contains(w))
                        .ok_or_else(|| bad(key, v, "a number from 1 to 10000"))?;
                }
                _ => return Err(OptionsError::Unknown(item.into())),
            }
        }
        o.check_qos()?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        let o = MountOptions::parse("_netdev,secret_file=/s,transport=tcp,stripe_unit=4M,threads=8,allow_other,attr_timeout=0.5").unwrap();
        assert_eq!(o.secret_file, PathBuf::from("/s"));
        assert_eq!(o.transport, TransportChoice::Tcp);
        assert_eq!(o.stripe_unit, 4 << 20);
        assert_eq!(o.threads, 8);
        assert!(o.allow_other);
        assert_eq!(o.attr_timeout, Duration::from_millis(500));
        assert_eq!(o.ignored, vec!["_netdev"]);
        let m = MountOptions::parse("metrics=localhost:9101").unwrap();
        assert_eq!(m.metrics, Some("127.0.0.1:9101".parse().unwrap()));
        let m = MountOptions::parse("metrics=[::1]:9101").unwrap();
        assert_eq!(m.metrics, Some("[::1]:9101".parse().unwrap()));
        assert_eq!(
            MountOptions::parse("poll_us=0").unwrap().poll,
            Duration::ZERO
        );
        assert_eq!(
            MountOptions::parse("poll_us=200").unwrap().poll,
            Duration::from_micros(200)
        );
        assert_eq!(MountOptions::parse("").unwrap(), MountOptions::default());
        for (bad, says) in [
            ("bogus", "unknown mount option \"bogus\""),
            ("transport=udp", "expected auto, shm, tcp or rdma"),
            ("stripe_unit=1000", "multiple of 4K"),
            ("stripe_unit=12Q", "unknown unit"),
            ("threads=0", "from 1 to 64"),
            ("secret_file=", "needs a value"),
            ("attr_timeout=-1", "seconds"),
            ("locks=maybe", "expected on or off"),
            ("keep_locks=1", "expected on or off"),
            ("kept_opens=-1", "from 0 to 1000000"),
            ("kept_opens=1000001", "from 0 to 1000000"),
            ("kept_opens=", "needs a value"),
            ("reservation=lots", "expected IOPS"),
            ("limit=-5", "expected IOPS"),
            ("weight=0", "from 1 to 10000"),
            ("qos=sometimes", "expected on or off"),
            ("cache=always", "none or writeback"),
            ("reservation=100,limit=50", "below reservation"),
            ("qos=off,reservation=100", "need qos=on"),
            ("ro=1", "unknown mount option"),
            ("replicas=0", "from 1 to 4"),
            ("replicas=5", "from 1 to 4"),
            ("read_policy=random", "adaptive or static"),
            ("metrics=9101", "HOST:PORT"),
            ("metrics=host.example:9101", "HOST:PORT"),
            ("metrics=127.0.0.1:99999", "HOST:PORT"),
            ("metrics=", "needs a value"),
            ("poll_us=10001", "from 0 to 10000"),
            ("poll_us=-1", "from 0 to 10000"),
        ] {
            let e = MountOptions::parse(bad).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    proptest! {
        #[test]
        fn never_panics(s in "[a-z_=,0-9./]{0,40}") {
            let _ = MountOptions::parse(&s);
        }

        #[test]
        fn ignored_options_are_accepted_in_any_order(picks in proptest::collection::vec(0usize..IGNORED.len(), 0..8)) {
            let s: Vec<&str> = picks.iter().map(|&i| IGNORED[i]).collect();
            let o = MountOptions::parse(&s.join(",")).unwrap();
            prop_assert_eq!(o.ignored.len(), s.len());
        }
    }
}
