//! `rackfs up` / `rackfs down`: a whole local cluster and a mount, for trying RackFS out.
//!
//! `up` starts memory nodes as child processes (shm transport, a generated secret), mounts
//! the filesystem in-process, prints where everything is, and runs until Ctrl-C, SIGTERM
//! (`rackfs down`) or an external `umount`; then it unmounts, stops the nodes and removes its
//! state. The nodes die with it even if it is killed (PR_SET_PDEATHSIG).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rackfs_memnode::config::Coordination;
use rackfs_proto::size::format_size;
use rackfs_verbs::Secret;

use rackfs_fs::error::{io, FsError};
use rackfs_fs::mount::{is_rackfs_mount, mount_type, path_tag, prepare, serve_metrics, state_dir};
use rackfs_fs::options::{MountOptions, TransportChoice};

use crate::error::CliError;
use crate::{enoteln, noteln, outln};

/// Default mount point of `rackfs up`.
pub const DEFAULT_DIR: &str = "/tmp/rackfs";

/// What `rackfs up` starts: how many nodes of which size, and the mount's options.
pub struct UpConfig {
    pub dir: PathBuf,
    pub nodes: u32,
    pub region: u64,
    /// The mount's options (`rackfs up -o`); its secret file is the instance's own.
    pub mount: MountOptions,
    /// Keep the cluster map, leases and election in a local etcd started here (instead of
    /// the coordinator embedded in the primary).
    pub etcd: bool,
}

/// The mount options of `rackfs up`: `-o`, with `--transport` unless `-o` names one.
pub fn mount_options(transport: &str, options: &str) -> Result<MountOptions, CliError> {
    let mut o = MountOptions::parse(options)?;
    let named = options
        .split(',')
        .any(|i| i.trim().starts_with("transport="));
    if !named {
        o.transport = if transport == "tcp" {
            TransportChoice::Tcp
        } else {
            TransportChoice::Auto
        };
    }
    Ok(o)
}

/// The files of one `rackfs up` instance.
pub fn instance_dir(mount: &Path) -> PathBuf {
    state_dir().join(format!("up-{}", path_tag(mount)))
}

fn memnode_binary() -> PathBuf {
    let next_to_us = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("rackfs-memnode")));
    match next_to_us {
        Some(p) if p.exists() => p,
        _ => PathBuf::from("rackfs-memnode"),
    }
}

/// One memory node `rackfs up` started, and keeps.
struct NodeProc {
    id: u32,
    child: Child,
    /// Its tcp address, once it said it serves (`None` while it starts or joins).
    tcp: Option<String>,
    /// Where it last served over tcp: started again, it listens there, so mounts and peers
    /// that knew the address reach it again (`None`: a port the kernel picks).
    listened: Option<String>,
    /// Where its ready line arrives (read off its stdout by a thread, so a node that joins
    /// slowly holds nothing up).
    ready: mpsc::Receiver<String>,
    /// Once it has ended: when it is to be started again (empty).
    restart_at: Option<Instant>,
    /// How many times it came back after dying.
    comebacks: u32,
}

/// This machine's QoS capacity for one node, `(C_G, C_L)` in IOPS: measured once per boot by
/// `rackfs-memnode --profile` (about 4 s) and kept in the state directory; `None` when the
/// profile could not run (the nodes then start from an assumed 1M IOPS and estimate online).
fn qos_capacity(inst: &Path) -> Option<(u64, u64)> {
    let cache = state_dir().join("qos-capacity");
    let parse = |text: &str| -> Option<(u64, u64)> {
        let mut words = text.split_whitespace().map(str::parse::<u64>);
        Some((words.next()?.ok()?, words.next()?.ok()?))
    };
    if let Some(c) = std::fs::read_to_string(&cache).ok().and_then(|t| parse(&t)) {
        return Some(c);
    }
    noteln!("measuring this machine's QoS capacity (once per boot, about 4 s)...");
    let out = Command::new(memnode_binary())
        .args([
            "--profile",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--region",
            "64M",
        ])
        .arg("--secret-file")
        .arg(inst.join("secret"))
        .arg("--shm-socket")
        .arg(inst.join("profile.sock"))
        .stderr(Stdio::null())
        .output();
    let line = match &out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        other => {
            tracing::warn!(result = ?other.as_ref().map(|o| o.status), "QoS capacity profile failed; assuming 1M IOPS per node");
            return None;
        }
    };
    // "profile (shm, 4 KiB READs): C_G = X IOPS, C_L = Y IOPS"
    let value = |key: &str| -> Option<u64> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    let c = (value("C_G = ")?, value("C_L = ")?);
    let _ = std::fs::write(&cache, format!("{} {}\n", c.0, c.1));
    Some(c)
}

/// How a node starts: as the first primary, by joining it, or (after a death) found in the
/// coordinator and taken in as a fresh, empty data node.
#[derive(Clone, Copy)]
enum Start<'a> {
    Primary,
    Join(&'a str),
    Rejoin,
}

/// Starts node `id` (its log appended to `mnID.log`); it is ready once it prints its line.
fn spawn_node(
    inst: &Path,
    id: u32,
    region: u64,
    start: Start,
    capacity: Option<(u64, u64)>,
    coordinator: &Coordination,
    listen: Option<&str>,
) -> Result<NodeProc, CliError> {
    let secret = inst.join("secret");
    let mut cmd = Command::new(memnode_binary());
    match coordinator {
        Coordination::Etcd(endpoints) => cmd.args(["--etcd", endpoints, "--cluster", "up"]),
        Coordination::Served(addr) => cmd.args(["--coordinator", addr]),
        Coordination::InPrimary => &mut cmd,
    };
    if let Some((global, local)) = capacity {
        cmd.args([
            "--qos-capacity",
            &global.to_string(),
            "--qos-client-capacity",
            &local.to_string(),
        ]);
    }
    cmd.args([
        "--listen",
        listen.unwrap_or("127.0.0.1:0"),
        "--region",
        &region.to_string(),
        "--node-id",
        &id.to_string(),
    ])
    .arg("--name")
    .arg(format!("mn{id}"))
    .arg("--secret-file")
    .arg(&secret)
    .arg("--shm-socket")
    .arg(inst.join(format!("mn{id}.sock")));
    match start {
        Start::Primary => cmd.arg("--primary"),
        Start::Join(p) => cmd.args(["--join", p]),
        Start::Rejoin => &mut cmd,
    };
    let log_path = inst.join(format!("mn{id}.log"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io("create", &log_path))?;
    // SAFETY: the closure only calls prctl(2), which is async-signal-safe, between fork and exec.
    // The signal comes when the thread that forked ends: this is always `up`'s main thread.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| CliError::NodeStart {
            name: format!("mn{id}"),
            last: format!(
                "cannot start {}: {e} (build it with cargo build --release)",
                memnode_binary().display()
            ),
        })?;
    let out = child.stdout.take().expect("piped");
    let (tx, ready) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        if let Some(tcp) = line.split_whitespace().find_map(|w| w.strip_prefix("tcp=")) {
            let _ = tx.send(tcp.to_string());
        }
    });
    Ok(NodeProc {
        id,
        child,
        tcp: None,
        listened: listen.map(str::to_string),
        ready,
        restart_at: None,
        comebacks: 0,
    })
}

/// Waits until `n` serves (or ends, or says nothing for a minute: the last line of its log
/// is the error).
fn wait_ready(inst: &Path, n: &mut NodeProc) -> Result<(), CliError> {
    match n.ready.recv_timeout(Duration::from_secs(60)) {
        Ok(tcp) => {
            n.listened = Some(tcp.clone());
            n.tcp = Some(tcp);
            Ok(())
        }
        Err(_) => {
            let _ = n.child.kill();
            let _ = n.child.wait();
            let log =
                std::fs::read_to_string(inst.join(format!("mn{}.log", n.id))).unwrap_or_default();
            Err(CliError::NodeStart {
                name: format!("mn{}", n.id),
                last: log.lines().last().unwrap_or("no output").into(),
            })
        }
    }
}

/// Whether `pid` is a live (not zombie) process.
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(pid, 0) == 0 };
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(false);
    exists && !zombie
}

/// Reads `key=value` lines of an instance's state file.
pub fn read_state(inst: &Path) -> Option<Vec<(String, String)>> {
    let text = std::fs::read_to_string(inst.join("up.state")).ok()?;
    Some(
        text.lines()
            .filter_map(|l| {
                l.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect(),
    )
}

/// The value of `key` in a state read by [`read_state`].
pub fn state_value(state: &[(String, String)], key: &str) -> Option<String> {
    state.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// Runs `rackfs up` in the foreground until stopped.
/// Its messages never end it: nobody reading them (`rackfs up | head -1`) must not leave the
/// mount and the nodes behind.
pub fn up(cfg: UpConfig) -> Result<(), CliError> {
    std::fs::create_dir_all(&cfg.dir).map_err(io("create", &cfg.dir))?;
    let dir = std::fs::canonicalize(&cfg.dir).map_err(io("resolve", &cfg.dir))?;
    let inst = instance_dir(&dir);
    if let Some(pid) = read_state(&inst)
        .and_then(|s| state_value(&s, "pid"))
        .and_then(|p| p.parse().ok())
    {
        if pid_alive(pid) {
            return Err(CliError::AlreadyUp { path: dir, pid });
        }
    }
    if let Some((fs_type, fs_source)) = mount_type(&dir) {
        return Err(FsError::Busy {
            path: dir,
            fs_source,
            fs_type,
        }
        .into());
    }
    let _ = std::fs::remove_dir_all(&inst);
    std::fs::create_dir_all(&inst).map_err(io("create", &inst))?;
    std::fs::set_permissions(&inst, std::fs::Permissions::from_mode(0o700))
        .map_err(io("set permissions of", &inst))?;
    let secret_file = inst.join("secret");
    std::fs::write(&secret_file, Secret::generate().expose()).map_err(io("write", &secret_file))?;
    std::fs::set_permissions(&secret_file, std::fs::Permissions::from_mode(0o600))
        .map_err(io("set permissions of", &secret_file))?;

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        signal_hook::flag::register(sig, stop.clone()).map_err(FsError::Signals)?;
    }
    let mut etcd = None;
    let mut served = None;
    let mut nodes = None;
    let result = (|| -> Result<(), CliError> {
        let coordinator = if cfg.etcd {
            let e = etcd.insert(rackfs_coord::EtcdServer::start(&inst)?);
            Coordination::Etcd(e.endpoints())
        } else {
            let path = inst.join("coord.sock");
            let secret = Secret::from_file(&secret_file).map_err(FsError::from)?;
            let s = rackfs_memnode::coordinator::CoordService::start(&path, secret, NODE_LEASE)
                .map_err(io("serve the coordinator on", &path))?;
            Coordination::Served(served.insert(s).addr())
        };
        let nodes = nodes.insert(Nodes {
            inst: inst.clone(),
            region: cfg.region,
            capacity: qos_capacity(&inst),
            coordinator,
            procs: Vec::new(),
            events: Vec::new(),
        });
        nodes.start_all(cfg.nodes)?;
        let opts = MountOptions {
            secret_file: secret_file.clone(),
            ..cfg.mount.clone()
        };
        let source = nodes.addrs().join(",");
        let prepared = prepare(&source, &dir, &opts)?;
        let fs = &prepared.fs;
        let (cluster, caches, releases) = (fs.cluster(), fs.caches(), fs.releases());
        serve_metrics(prepared.metrics, &cluster, &dir)?;
        let session =
            fuser::spawn_mount(prepared.fs, &dir, &prepared.config).map_err(io("mount", &dir))?;
        rackfs_fs::releases::spawn(&cluster, releases);
        rackfs_fs::watch::spawn(cluster, session.notifier(), caches, opts.attr_timeout);
        let _record = prepared.record;
        let state = |nodes: &Nodes| {
            let mut text = format!(
                "pid={}\nmount={}\nprimary={}\nsecret_file={}\nnodes={}\nready=1\n",
                std::process::id(),
                dir.display(),
                nodes.addrs().join(","),
                secret_file.display(),
                cfg.nodes
            );
            let back: Vec<String> = nodes
                .procs
                .iter()
                .map(|p| p.comebacks.to_string())
                .collect();
            text.push_str(&format!("comebacks={}\n", back.join(",")));
            for e in &nodes.events {
                text.push_str(&format!("event={e}\n"));
            }
            let file = inst.join("up.state");
            std::fs::write(&file, text).map_err(io("write", &file))
        };
        state(nodes)?;
        noteln!("RackFS is up.");
        noteln!("  mount point : {}", dir.display());
        noteln!(
            "  cluster     : {source} (primary mn0), {} memory node(s) x {}, transport {}",
            cfg.nodes,
            format_size(cfg.region),
            match opts.transport {
                TransportChoice::Tcp => "tcp",
                _ => "shm",
            }
        );
        noteln!("  secret file : {}", secret_file.display());
        match &nodes.coordinator {
            Coordination::Etcd(e) => noteln!(
                "  coordinator : etcd at {e} (cluster \"up\"; log {})",
                inst.join("etcd.log").display()
            ),
            Coordination::Served(a) => noteln!("  coordinator : in this process, at {a}"),
            Coordination::InPrimary => noteln!("  coordinator : embedded in the primary (mn0)"),
        }
        if cfg.nodes > 1 {
            noteln!(
                "  failover    : a standby follows the primary; a node that dies is started \
                 again, empty, and rejoins"
            );
        }
        match nodes.capacity {
            Some((g, l)) => noteln!(
                "  QoS unit    : IOPS of 4 KiB; each node's capacity {g} IOPS, {l} per mount \
                 (measured on this machine; delete {} to measure again)",
                state_dir().join("qos-capacity").display()
            ),
            None => {
                noteln!("  QoS unit    : IOPS of 4 KiB; node capacity not measured (1M assumed)")
            }
        }
        noteln!(
            "  try it      : echo hello > {}/hello && cat {}/hello && rackfs status",
            dir.display(),
            dir.display()
        );
        noteln!(
            "  stop it     : rackfs down {}   (or Ctrl-C here)",
            dir.display()
        );
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
            if !is_rackfs_mount(&dir) {
                noteln!("{} was unmounted", dir.display());
                break;
            }
            match nodes.tend() {
                Tended::Same => {}
                Tended::Changed => state(nodes)?,
                Tended::Lost => break,
            }
        }
        if mount_type(&dir).is_some() {
            let _ = session.umount_and_join();
        }
        Ok(())
    })();
    if let Some(n) = nodes.as_mut() {
        n.stop();
    }
    drop(etcd);
    drop(served);
    let _ = std::fs::remove_dir_all(&inst);
    if result.is_ok() {
        noteln!("RackFS at {} is down.", dir.display());
    }
    result
}

/// The nodes' lease with the coordinator (`rackfs-memnode`'s default): a dead node may rejoin
/// once it has lapsed.
const NODE_LEASE: Duration = Duration::from_millis(2000);

/// What [`Nodes::tend`] saw.
enum Tended {
    Same,
    /// A node died or came back: the state file is to be written again.
    Changed,
    /// The only node died: the namespace went with it.
    Lost,
}

/// The memory nodes `rackfs up` keeps running: one that dies is started again as a fresh,
/// empty data node once its lease has lapsed (it rejoins the primary under a new epoch, and
/// re-replication fills it), and what happened is kept for `rackfs status`.
struct Nodes {
    inst: PathBuf,
    region: u64,
    capacity: Option<(u64, u64)>,
    coordinator: Coordination,
    procs: Vec<NodeProc>,
    /// What happened, newest last (at most [`Nodes::EVENTS`]).
    events: Vec<String>,
}

impl Nodes {
    const EVENTS: usize = 10;

    /// Starts `n` nodes: mn0 the primary, the others joining it over its Unix socket.
    fn start_all(&mut self, n: u32) -> Result<(), CliError> {
        let primary = format!("unix:{}", self.inst.join("mn0.sock").display());
        for id in 0..n {
            let start = if id == 0 {
                Start::Primary
            } else {
                Start::Join(&primary)
            };
            let mut p = spawn_node(
                &self.inst,
                id,
                self.region,
                start,
                self.capacity,
                &self.coordinator,
                None,
            )?;
            let ready = wait_ready(&self.inst, &mut p);
            self.procs.push(p);
            ready?;
        }
        Ok(())
    }

    /// The tcp addresses of the nodes that serve.
    fn addrs(&self) -> Vec<String> {
        let live = self.procs.iter().filter(|p| p.restart_at.is_none());
        live.filter_map(|p| p.tcp.clone()).collect()
    }

    fn event(&mut self, what: String) {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let at = format!(
            "{:02}:{:02}:{:02}",
            secs / 3600 % 24,
            secs / 60 % 60,
            secs % 60
        );
        if self.events.len() == Self::EVENTS {
            self.events.remove(0);
        }
        self.events.push(format!("{at} UTC {what}"));
    }

    /// Notes deaths and returns, and starts dead nodes again when their time comes.
    fn tend(&mut self) -> Tended {
        let mut changed = false;
        let only = self.procs.len() == 1;
        let rejoin_after = NODE_LEASE + Duration::from_millis(500);
        let mut said = Vec::new();
        for p in self.procs.iter_mut() {
            let log = self.inst.join(format!("mn{}.log", p.id));
            if p.restart_at.is_none() {
                if let Ok(tcp) = p.ready.try_recv() {
                    p.comebacks += 1;
                    said.push(format!(
                        "mn{} is back as an empty data node at {tcp}; re-replication refills it",
                        p.id
                    ));
                    p.listened = Some(tcp.clone());
                    p.tcp = Some(tcp);
                }
                if let Ok(Some(status)) = p.child.try_wait() {
                    p.restart_at = Some(Instant::now() + rejoin_after);
                    // A node that died serving says nothing of why; one refused, its error.
                    let why = match p.tcp.take() {
                        Some(_) => format!("exited ({status}; log {})", log.display()),
                        None => {
                            // Perhaps its old port is taken now: the next start lets the
                            // kernel pick one.
                            p.listened = None;
                            let text = std::fs::read_to_string(&log).unwrap_or_default();
                            let last = text.lines().last().unwrap_or("no output").to_string();
                            format!("could not rejoin ({status}): {last}")
                        }
                    };
                    said.push(format!(
                        "mn{} {why}; starting it again, empty, in {} ms",
                        p.id,
                        rejoin_after.as_millis()
                    ));
                }
            }
        }
        for what in said.drain(..) {
            enoteln!("{what}");
            self.event(what);
            changed = true;
        }
        if only && self.procs[0].restart_at.is_some() {
            enoteln!("mn0 was the only node and held the namespace: nothing is left to serve");
            return Tended::Lost;
        }
        let now = Instant::now();
        for i in 0..self.procs.len() {
            let p = &self.procs[i];
            if p.restart_at.is_none_or(|t| now < t) {
                continue;
            }
            let id = p.id;
            match spawn_node(
                &self.inst,
                id,
                self.region,
                Start::Rejoin,
                self.capacity,
                &self.coordinator,
                self.procs[i].listened.as_deref(),
            ) {
                Ok(p) => {
                    let comebacks = self.procs[i].comebacks;
                    self.procs[i] = NodeProc { comebacks, ..p };
                }
                Err(e) => {
                    self.procs[i].restart_at = Some(now + rejoin_after);
                    let what = format!("mn{id} cannot be started again: {e}");
                    enoteln!("{what}");
                    self.event(what);
                    changed = true;
                }
            }
        }
        if changed {
            Tended::Changed
        } else {
            Tended::Same
        }
    }

    /// Stops every node (SIGTERM, then SIGKILL after 5 s).
    fn stop(&mut self) {
        for n in self.procs.iter().filter(|n| n.restart_at.is_none()) {
            // SAFETY: kill(2) on our own child, not yet reaped (so its pid is still ours).
            unsafe { libc::kill(n.child.id() as i32, libc::SIGTERM) };
        }
        for n in self.procs.iter_mut() {
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end && matches!(n.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
    }
}

/// Starts `rackfs up` in the background and returns once it is ready.
pub fn up_detached(dir: &Path, forward: Vec<String>) -> Result<(), CliError> {
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let dir = std::fs::canonicalize(dir).map_err(io("resolve", dir))?;
    let inst = instance_dir(&dir);
    std::fs::create_dir_all(state_dir()).map_err(io("create", state_dir()))?;
    let log = state_dir().join(format!("up-{}.log", path_tag(&dir)));
    let exe = std::env::current_exe().map_err(io("find", "the rackfs executable"))?;
    let logf = std::fs::File::create(&log).map_err(io("create", &log))?;
    let mut child = Command::new(&exe)
        .args(forward)
        .stdin(Stdio::null())
        .stdout(logf.try_clone().map_err(io("open", &log))?)
        .stderr(logf)
        .process_group(0)
        .spawn()
        .map_err(io("start", &exe))?;
    let end = Instant::now() + Duration::from_secs(30);
    while Instant::now() < end {
        if let Ok(Some(st)) = child.try_wait() {
            // The run failed: its log is shown here and not kept.
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            let lines: Vec<&str> = text.lines().collect();
            for l in &lines[lines.len().saturating_sub(10)..lines.len().saturating_sub(1)] {
                enoteln!("  {l}");
            }
            return Err(FsError::Exited {
                what: "rackfs up",
                status: st,
                last: lines.last().copied().unwrap_or("").into(),
            }
            .into());
        }
        if read_state(&inst).is_some_and(|s| state_value(&s, "ready").is_some()) {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            crate::out::print(format_args!("{text}"));
            outln!(
                "  (running in the background, pid {}; log {})",
                child.id(),
                log.display()
            );
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    Err(FsError::Timeout {
        what: "rackfs up".into(),
        goal: "become ready",
        secs: 30,
        log,
    }
    .into())
}

/// Stops the `rackfs up` instance mounted at `dir`.
pub fn down(dir: &Path) -> Result<(), CliError> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let inst = instance_dir(&dir);
    let state = read_state(&inst).ok_or_else(|| CliError::NotUp(dir.clone()))?;
    let pid: i32 = state_value(&state, "pid")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| CliError::CorruptState(inst.join("up.state")))?;
    if !pid_alive(pid) {
        // It was killed: its nodes died with it (PDEATHSIG); detach the dead mount.
        if mount_type(&dir).is_some() {
            let _ = Command::new("umount").arg("-l").arg(&dir).status();
        }
        let _ = std::fs::remove_dir_all(&inst);
        let _ = std::fs::remove_file(state_dir().join(format!("up-{}.log", path_tag(&dir))));
        return Err(CliError::Gone { path: dir, pid });
    }
    // SAFETY: sending SIGTERM to the pid recorded by `rackfs up`.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if !pid_alive(pid) || !inst.exists() {
            while pid_alive(pid) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
            // A mount busy at that moment (a process still using it) could not be unmounted
            // and outlived its daemon: detach it, as for a killed instance.
            if !pid_alive(pid) && rackfs_fs::mount::is_rackfs_mount(&dir) {
                let _ = Command::new("umount").arg("-l").arg(&dir).status();
            }
            // The instance is gone cleanly: so is the log of its detached run.
            let _ = std::fs::remove_file(state_dir().join(format!("up-{}.log", path_tag(&dir))));
            outln!("RackFS at {} is down.", dir.display());
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(FsError::Timeout {
        what: format!("rackfs up (pid {pid})"),
        goal: "stop",
        secs: 20,
        log: state_dir().join(format!("up-{}.log", path_tag(&dir))),
    }
    .into())
}
