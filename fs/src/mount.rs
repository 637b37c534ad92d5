//! Mounting: from a cluster address and options to a live FUSE session, in the foreground or
//! as a background daemon that `mount` returns from once the filesystem is visible.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, SessionACL};
use rackfs_verbs::Secret;
use tracing::info;

use crate::cluster::Cluster;
use crate::env::Env;
use crate::error::{io, FsError};
use crate::fuse::RackFs;
use crate::options::MountOptions;

/// Whether `dir` is currently a mount point: its filesystem type and source.
pub fn mount_type(dir: &Path) -> Option<(String, String)> {
    // A FUSE mount whose daemon died cannot be resolved (ENOTCONN): it is looked up as given.
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        (Path::new(&unescape(f.get(4)?)) == dir)
            .then(|| Some((f.get(sep + 1)?.to_string(), unescape(f.get(sep + 2)?))))?
    })
}

/// Whether `dir` is a RackFS mount (a FUSE mount whose source is `rackfs:...`).
pub fn is_rackfs_mount(dir: &Path) -> bool {
    mount_type(dir).is_some_and(|(t, src)| t.starts_with("fuse") && src.starts_with("rackfs:"))
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// The cluster addresses in a mount source: `HOST:PORT[,HOST:PORT...]`, `unix:PATH`.
pub fn parse_source(source: &str) -> Result<Vec<String>, FsError> {
    let addrs: Vec<String> = source
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if addrs.is_empty() {
        return Err(FsError::Address {
            addr: source.into(),
            expected: "HOST:PORT[,HOST:PORT...]",
        });
    }
    for a in &addrs {
        if a.starts_with("unix:") {
            continue;
        }
        match a.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
            _ => {
                return Err(FsError::Address {
                    addr: a.clone(),
                    expected: "HOST:PORT or unix:PATH",
                })
            }
        }
    }
    Ok(addrs)
}

/// Checks the mount point before anything connects.
pub fn check_mount_point(dir: &Path) -> Result<PathBuf, FsError> {
    let at = |err| FsError::MountPoint {
        path: dir.into(),
        err,
    };
    let meta = std::fs::metadata(dir).map_err(at)?;
    if !meta.is_dir() {
        return Err(FsError::NotADirectory(dir.into()));
    }
    if let Some((fs_type, fs_source)) = mount_type(dir) {
        return Err(FsError::Busy {
            path: dir.into(),
            fs_source,
            fs_type,
        });
    }
    std::fs::canonicalize(dir).map_err(at)
}

/// What `rackfs status DIR` and `rackfs qos set DIR` need to know about a live mount, kept in
/// the state directory (`mount-TAG.state`) for as long as it is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRecord {
    pub source: String,
    pub secret_file: PathBuf,
    /// The mount's QoS slot (`None`: `qos=off`).
    pub qos_slot: Option<u16>,
}

impl MountRecord {
    fn path(dir: &Path) -> PathBuf {
        state_dir().join(format!("mount-{}.state", path_tag(dir)))
    }

    /// The record of the mount at `dir` (canonical path), if it has one (and its mount process
    /// lives).
    pub fn read(dir: &Path) -> Option<MountRecord> {
        let text = std::fs::read_to_string(Self::path(dir)).ok()?;
        let get = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix('='))
                .map(str::to_string)
        };
        if !process_lives(&text) {
            return None;
        }
        Some(MountRecord {
            source: get("source")?,
            secret_file: PathBuf::from(get("secret_file")?),
            qos_slot: get("qos_slot").and_then(|s| s.parse().ok()),
        })
    }

    /// Writes the record; it is removed when the returned guard drops (the mount ended).
    fn keep(&self, dir: &Path) -> RecordGuard {
        RecordGuard(self.write(dir))
    }

    /// Writes (or rewrites) the record, with this process's pid; its path if it was written.
    /// Records of mounts whose process died without removing them (SIGKILL) go first.
    fn write(&self, dir: &Path) -> Option<PathBuf> {
        prune_dead_records();
        let path = Self::path(dir);
        let mut text = format!(
            "source={}\nsecret_file={}\npid={}\n",
            self.source,
            self.secret_file.display(),
            std::process::id()
        );
        if let Some(s) = self.qos_slot {
            text.push_str(&format!("qos_slot={s}\n"));
        }
        let written =
            std::fs::create_dir_all(state_dir()).is_ok() && std::fs::write(&path, text).is_ok();
        written.then_some(path)
    }
}

/// Whether the process named by a record's `pid=` line is alive (a record without one is
/// from an older version: trusted).
fn process_lives(record: &str) -> bool {
    match record.lines().find_map(|l| l.strip_prefix("pid=")) {
        Some(pid) => Path::new("/proc").join(pid.trim()).exists(),
        None => true,
    }
}

/// Removes the records of mounts whose process is gone.
fn prune_dead_records() {
    let Ok(dir) = std::fs::read_dir(state_dir()) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("mount-") && name.ends_with(".state") {
            if let Ok(text) = std::fs::read_to_string(e.path()) {
                if !process_lives(&text) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

/// Removes a mount's record when the mount ends.
pub struct RecordGuard(Option<PathBuf>);

impl Drop for RecordGuard {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A mount ready to start: the filesystem, its FUSE configuration, the canonical mount point,
/// and its record (kept while this lives).
pub struct Prepared {
    pub fs: RackFs,
    pub config: Config,
    pub dir: PathBuf,
    pub record: RecordGuard,
    /// Where the mount's metrics are served (`-o metrics=ADDR`), bound already.
    pub metrics: Option<std::net::TcpListener>,
}

/// Connects to the cluster and builds the FUSE configuration for a mount.
pub fn prepare(source: &str, dir: &Path, opts: &MountOptions) -> Result<Prepared, FsError> {
    let addrs = parse_source(source)?;
    let dir = check_mount_point(dir)?;
    // Bound before anything else: an address that cannot be served fails the mount at once.
    let metrics = match opts.metrics {
        Some(addr) => {
            Some(std::net::TcpListener::bind(addr).map_err(|err| FsError::Metrics { addr, err })?)
        }
        None => None,
    };
    let secret = Secret::from_file(&opts.secret_file)?;
    let name = format!("mount:{}", dir.display());
    // The mount is where the core meets the host: its clocks.
    let cluster = Cluster::connect(
        Env::real(opts.poll),
        &addrs,
        secret,
        opts.transport,
        opts.rdma_device.clone(),
        &name,
    )?;
    cluster.set_deadline(opts.timeout);
    cluster.loads.set_policy(opts.read_policy);
    let qos_slot = match opts.qos {
        true => Some(
            cluster
                .enable_qos(opts.reservation, opts.limit, opts.weight)
                .map_err(FsError::Qos)?,
        ),
        false => None,
    };
    let record = MountRecord {
        source: source.into(),
        secret_file: opts.secret_file.clone(),
        qos_slot,
    }
    .keep(&dir);
    {
        // A mount fenced by the primary continues in a new session, with a new QoS slot; one
        // whose primary died, on the primary that took over (`rackfs status DIR` asks it).
        let (source, secret_file, dir) =
            (source.to_string(), opts.secret_file.clone(), dir.clone());
        cluster.on_new_session(move |qos_slot, primary| {
            let record = MountRecord {
                source: primary.unwrap_or(&source).to_string(),
                secret_file: secret_file.clone(),
                qos_slot,
            };
            record.write(&dir);
        });
    }
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!("rackfs:{source}")),
        // The kernel's own subtype option: the mount shows as type fuse.rackfs (fuser passes
        // MountOption::Subtype only to fusermount, which a root mount does not use).
        MountOption::CUSTOM("subtype=rackfs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    if opts.read_only {
        config.mount_options.push(MountOption::RO);
    }
    config.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(opts.threads);
    config.clone_fd = true;
    let cluster = Arc::new(cluster);
    if opts.qos {
        cluster.start_qos_ticker();
    }
    Ok(Prepared {
        fs: RackFs::new(cluster, opts.clone()),
        config,
        dir,
        record,
        metrics,
    })
}

/// Serves mount `dir`'s metrics on `listener` (`-o metrics=ADDR`), if any, from a thread.
pub fn serve_metrics(
    listener: Option<std::net::TcpListener>,
    cluster: &Arc<Cluster>,
    dir: &Path,
) -> Result<(), FsError> {
    let Some(listener) = listener else {
        return Ok(());
    };
    let (cl, mount) = (cluster.clone(), dir.display().to_string());
    info!(addr = ?listener.local_addr().ok(), "serving the mount's metrics");
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || rackfs_metrics::serve(listener, || cl.render_metrics(&mount)))
        .map(|_| ())
        .map_err(FsError::Signals)
}

/// Mounts and serves until unmounted or signalled (SIGTERM, SIGINT, SIGHUP unmount cleanly).
pub fn run_foreground(source: &str, dir: &Path, opts: &MountOptions) -> Result<(), FsError> {
    let Prepared {
        fs,
        config,
        dir,
        record,
        metrics,
    } = prepare(source, dir, opts)?;
    let (cluster, caches, releases) = (fs.cluster(), fs.caches(), fs.releases());
    serve_metrics(metrics, &cluster, &dir)?;
    let mut session = fuser::Session::new(fs, &dir, &config).map_err(io("mount", &dir))?;
    crate::releases::spawn(&cluster, releases);
    crate::watch::spawn(cluster, session.notifier(), caches, opts.attr_timeout);
    let mut unmounter = session.unmount_callable();
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])
            .map_err(FsError::Signals)?;
    let handle = signals.handle();
    let shown = dir.clone();
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            info!(signal = sig, mount = %shown.display(), "unmounting");
            let _ = unmounter.unmount();
        }
    });
    info!(mount = %dir.display(), %source, "mounted");
    let r = session.run().map_err(FsError::Session);
    handle.close();
    drop(record);
    if r.is_ok() {
        // A background mount's log goes with it when it ends cleanly.
        let _ = std::fs::remove_file(daemon_log(&dir));
    }
    r
}

/// Starts `program args` as a detached daemon logging to `log`, and waits until `dir` shows up
/// as a RackFS mount (or the daemon fails, whose log is then returned as the error).
pub fn spawn_daemon(
    program: &Path,
    args: &[String],
    dir: &Path,
    log: &Path,
) -> Result<u32, FsError> {
    use std::os::unix::process::CommandExt;
    let logf = std::fs::File::create(log).map_err(io("create log", log))?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(logf.try_clone().map_err(io("open log", log))?)
        .stderr(logf)
        .process_group(0)
        .spawn()
        .map_err(io("start", program))?;
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if let Ok(Some(status)) = child.try_wait() {
            // The failure is reported here (its last line); its log is not kept.
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let _ = std::fs::remove_file(log);
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no output");
            return Err(FsError::Exited {
                what: "mount",
                status,
                last: last.into(),
            });
        }
        if is_rackfs_mount(dir) {
            return Ok(child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    Err(FsError::Timeout {
        what: "mount".into(),
        goal: "appear",
        secs: 20,
        log: log.into(),
    })
}

/// The log of a background mount of `dir` (canonical path).
fn daemon_log(dir: &Path) -> PathBuf {
    state_dir().join(format!("mount-{}.log", path_tag(dir)))
}

/// Where `rackfs` keeps runtime state (logs, `rackfs up` instances).
pub fn state_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/rackfs");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => Path::new(&d).join("rackfs"),
        // SAFETY: as above.
        None => std::env::temp_dir().join(format!("rackfs-{}", unsafe { libc::geteuid() })),
    }
}

/// A file-name-safe rendering of a path.
pub fn path_tag(p: &Path) -> String {
    let s: String = p
        .display()
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    s.trim_matches('-').to_string()
}

/// A mount that [`mount_command`] left serving in the background. Its `Display` is the line
/// the commands print; they print it themselves, each in its own way of writing to stdout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Daemon {
    pub source: String,
    /// The canonical mount point.
    pub dir: PathBuf,
    pub pid: u32,
    pub log: PathBuf,
}

impl std::fmt::Display for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mounted {} on {} (pid {}, log {})",
            self.source,
            self.dir.display(),
            self.pid,
            self.log.display()
        )
    }
}

/// `rackfs mount` / `mount.rackfs`: mount in the foreground (`None` once it has ended), or
/// daemonize by re-running `program` with `foreground_args` and wait for the mount to appear.
pub fn mount_command(
    source: &str,
    dir: &Path,
    opts_text: &str,
    foreground: bool,
    program: &Path,
    foreground_args: Vec<String>,
) -> Result<Option<Daemon>, FsError> {
    let opts = MountOptions::parse(opts_text)?;
    if foreground {
        return run_foreground(source, dir, &opts).map(|()| None);
    }
    // Fail fast, with the real reason, on what can be checked without mounting.
    parse_source(source)?;
    let canon = check_mount_point(dir)?;
    Secret::from_file(&opts.secret_file)?;
    let logs = state_dir();
    std::fs::create_dir_all(&logs).map_err(io("create", &logs))?;
    let log = daemon_log(&canon);
    let pid = spawn_daemon(program, &foreground_args, &canon, &log)?;
    Ok(Some(Daemon {
        source: source.into(),
        dir: canon,
        pid,
        log,
    }))
}
