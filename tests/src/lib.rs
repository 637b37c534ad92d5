//! Test harness: real memory-node processes, and one environment trait under which the verbs
//! conformance cases run on every transport.

use std::cell::RefCell;
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::time::Duration;

use rackfs_verbs::sim::{Sim, SimConfig, SIM_RKEY, SIM_RO_RKEY};
use rackfs_verbs::{block_on, QueuePair, RegionInfo, Secret};

/// Path of a binary built from this workspace (`target/<profile>/NAME`).
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("RACKFS_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().expect("deps dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("profile dir")
    } else {
        dir
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not built: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// A private scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let mut n = [0u8; 6];
        n.copy_from_slice(&rackfs_verbs::auth::nonce()[..6]);
        let hex: String = n.iter().map(|b| format!("{b:02x}")).collect();
        let p = std::env::temp_dir().join(format!("rackfs-{tag}-{hex}"));
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `rackfs-memnode` child process with a TCP listener on loopback and a Unix socket.
pub struct MemNodeProcess {
    pub child: Child,
    pub tcp: String,
    pub shm: PathBuf,
    pub secret: Secret,
    pub secret_file: PathBuf,
    pub stderr_log: PathBuf,
    pub dir: TempDir,
}

impl MemNodeProcess {
    pub fn start(region: &str) -> MemNodeProcess {
        Self::start_with(region, Secret::generate(), &[])
    }

    pub fn start_with(region: &str, secret: Secret, extra: &[&str]) -> MemNodeProcess {
        let dir = TempDir::new("mn");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, secret.expose()).expect("write secret");
        let shm = dir.path().join("mn.sock");
        let stderr_log = dir.path().join("stderr.log");
        let mut child = Command::new(bin_path("rackfs-memnode"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--region",
                region,
                "--secret-file",
            ])
            .arg(&secret_file)
            .arg("--shm-socket")
            .arg(&shm)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).expect("stderr log"))
            .spawn()
            .expect("spawn rackfs-memnode");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read ready line");
        let tcp = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("tcp="))
            .unwrap_or_else(|| {
                panic!(
                    "no ready line from rackfs-memnode: {line:?}; stderr: {}",
                    std::fs::read_to_string(&stderr_log).unwrap_or_default()
                )
            })
            .to_string();
        MemNodeProcess {
            child,
            tcp,
            shm,
            secret,
            secret_file,
            stderr_log,
            dir,
        }
    }

    pub fn tcp_qp(&self) -> QueuePair {
        rackfs_verbs::tcp::connect(&self.tcp, &self.secret, "test").expect("tcp connect")
    }

    pub fn shm_qp(&self) -> QueuePair {
        rackfs_verbs::shm::connect(&self.shm, &self.secret, "test").expect("shm connect")
    }

    pub fn control(&self) -> rackfs_proto::ControlClient {
        rackfs_proto::ControlClient::connect_tcp(&self.tcp, &self.secret, "test")
            .expect("control connect")
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits; returns the exit status code.
    pub fn stop(mut self) -> Option<i32> {
        // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait for memnode").code()
    }
}

impl Drop for MemNodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Where a conformance case runs: how to get queue pairs and how to drive async bodies.
pub trait Env {
    fn name(&self) -> &'static str;
    fn qp(&mut self) -> QueuePair;
    /// The read-write data region and a read-only region.
    fn data_region(&self) -> RegionInfo;
    fn ro_region(&self) -> RegionInfo;
    /// Runs one async body to completion.
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T;
    /// Runs `n` workers, each on its own queue pair, concurrently, to completion.
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static;
}

fn region_by(qp: &QueuePair, want_write: bool) -> RegionInfo {
    *qp.regions()
        .iter()
        .find(|r| r.access.contains(rackfs_verbs::Access::WRITE) == want_write)
        .expect("region of the wanted kind")
}

/// How a test reaches a real memory node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    Shm,
    Tcp,
    /// RC queue pairs on this RDMA device (the node serves it with `--rdma-device`).
    Rdma(String),
}

/// A real memory node reached over `shm`, `tcp` or `rdma`.
pub struct NodeEnv {
    pub node: MemNodeProcess,
    pub via: Via,
    data: RegionInfo,
    ro: RegionInfo,
}

impl NodeEnv {
    pub fn new(shm: bool) -> NodeEnv {
        Self::over(if shm { Via::Shm } else { Via::Tcp })
    }

    pub fn over(via: Via) -> NodeEnv {
        let node = match &via {
            Via::Rdma(dev) => {
                MemNodeProcess::start_with("16M", Secret::generate(), &["--rdma-device", dev])
            }
            _ => MemNodeProcess::start("16M"),
        };
        let qp = connect(&node, &via);
        NodeEnv {
            data: region_by(&qp, true),
            ro: region_by(&qp, false),
            node,
            via,
        }
    }
}

/// A queue pair to `node` over `via`.
pub fn connect(node: &MemNodeProcess, via: &Via) -> QueuePair {
    match via {
        Via::Shm => node.shm_qp(),
        Via::Tcp => node.tcp_qp(),
        Via::Rdma(dev) => rackfs_verbs::rdma::connect(&node.tcp, &node.secret, "test", Some(dev))
            .unwrap_or_else(|e| panic!("rdma connect: {e}; node log: {}", node.stderr())),
    }
}

impl Env for NodeEnv {
    fn name(&self) -> &'static str {
        match self.via {
            Via::Shm => "shm",
            Via::Tcp => "tcp",
            Via::Rdma(_) => "rdma",
        }
    }
    fn qp(&mut self) -> QueuePair {
        connect(&self.node, &self.via)
    }
    fn data_region(&self) -> RegionInfo {
        self.data
    }
    fn ro_region(&self) -> RegionInfo {
        self.ro
    }
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T {
        block_on(f)
    }
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let f = std::sync::Arc::new(f);
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let qp = self.qp();
                let f = f.clone();
                std::thread::spawn(move || block_on(f(i, qp)))
            })
            .collect();
        for h in handles {
            h.join().expect("worker thread");
        }
    }
}

/// The deterministic simulator.
pub struct SimEnv {
    pub sim: Sim,
}

impl SimEnv {
    pub fn new(seed: u64) -> SimEnv {
        SimEnv {
            sim: Sim::new(SimConfig {
                seed,
                region_len: 16 << 20,
                ..SimConfig::default()
            }),
        }
    }
}

impl Env for SimEnv {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn qp(&mut self) -> QueuePair {
        let c = self.sim.add_client();
        self.sim.handle().connect(c)
    }
    fn data_region(&self) -> RegionInfo {
        RegionInfo {
            rkey: SIM_RKEY,
            len: 16 << 20,
            access: rackfs_verbs::Access::ALL,
        }
    }
    fn ro_region(&self) -> RegionInfo {
        RegionInfo {
            rkey: SIM_RO_RKEY,
            len: 4096,
            access: rackfs_verbs::Access::READ,
        }
    }
    fn run<T: 'static, F: Future<Output = T> + 'static>(&mut self, f: F) -> T {
        let out = Rc::new(RefCell::new(None));
        let o = out.clone();
        let c = self.sim.add_client();
        self.sim.spawn(c, async move {
            *o.borrow_mut() = Some(f.await);
        });
        let outcome = self.sim.run(Duration::from_secs(3600));
        assert_eq!(outcome, rackfs_verbs::sim::RunOutcome::Finished);
        let v = out.borrow_mut().take();
        v.expect("task finished")
    }
    fn run_parallel<F, Fut>(&mut self, n: usize, f: F)
    where
        F: Fn(usize, QueuePair) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        for i in 0..n {
            let c = self.sim.add_client();
            let qp = self.sim.handle().connect(c);
            self.sim.spawn(c, f(i, qp));
        }
        let outcome = self.sim.run(Duration::from_secs(3600));
        assert_eq!(outcome, rackfs_verbs::sim::RunOutcome::Finished);
    }
}

/// A cluster of memory-node processes: node 0 is the primary, the others join it.
pub struct TestCluster {
    pub nodes: Vec<Option<MemNodeProcess>>,
    pub secret_file: PathBuf,
    _dir: TempDir,
}

impl TestCluster {
    /// `n` nodes of `region` each; freed file data is quarantined for 200 ms.
    pub fn start(n: usize, region: &str) -> TestCluster {
        Self::start_with(n, region, &[])
    }

    /// [`TestCluster::start`] with more `rackfs-memnode` flags for every node.
    pub fn start_with(n: usize, region: &str, extra: &[&str]) -> TestCluster {
        let secret = Secret::generate();
        let dir = TempDir::new("cluster");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, secret.expose()).expect("write secret");
        let mut nodes = Vec::new();
        let first = MemNodeProcess::start_with(
            region,
            secret.clone(),
            &[
                &[
                    "--primary",
                    "--node-id",
                    "0",
                    "--name",
                    "mn0",
                    "--quarantine-ms",
                    "200",
                ],
                extra,
            ]
            .concat(),
        );
        let primary = first.tcp.clone();
        nodes.push(Some(first));
        for i in 1..n {
            let id = i.to_string();
            let name = format!("mn{i}");
            nodes.push(Some(MemNodeProcess::start_with(
                region,
                secret.clone(),
                &[
                    &[
                        "--join",
                        primary.as_str(),
                        "--node-id",
                        &id,
                        "--name",
                        &name,
                        "--quarantine-ms",
                        "200",
                    ],
                    extra,
                ]
                .concat(),
            )));
        }
        TestCluster {
            nodes,
            secret_file,
            _dir: dir,
        }
    }

    /// The primary's TCP address (a mount source).
    pub fn addr(&self) -> String {
        self.nodes[0].as_ref().expect("primary running").tcp.clone()
    }

    pub fn control(&self, i: usize) -> rackfs_proto::ControlClient {
        self.nodes[i].as_ref().expect("node running").control()
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut n) = self.nodes[i].take() {
            let _ = n.child.kill();
            let _ = n.child.wait();
        }
    }
}

/// A real FUSE mount served by a `rackfs mount --foreground` child process.
pub struct Mount {
    pub child: Child,
    pub dir: PathBuf,
    pub log: PathBuf,
    _tmp: TempDir,
}

impl Mount {
    /// Mounts `cluster` with extra `-o` options (the secret file is added).
    pub fn new(cluster: &TestCluster, opts: &str) -> Mount {
        Self::try_new(&cluster.addr(), &cluster.secret_file, opts)
            .unwrap_or_else(|e| panic!("mount failed: {e}"))
    }

    pub fn try_new(source: &str, secret_file: &Path, opts: &str) -> Result<Mount, String> {
        let tmp = TempDir::new("mnt");
        let dir = tmp.path().join("m");
        std::fs::create_dir(&dir).expect("mount dir");
        let log = tmp.path().join("mount.log");
        let mut all = format!("secret_file={}", secret_file.display());
        if !opts.is_empty() {
            all.push(',');
            all.push_str(opts);
        }
        let child = Command::new(bin_path("rackfs"))
            .args(["mount", "--foreground", source])
            .arg(&dir)
            .args(["-o", &all])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn rackfs mount");
        let mut m = Mount {
            child,
            dir,
            log,
            _tmp: tmp,
        };
        let ok = wait_for(Duration::from_secs(15), || {
            rackfs_fs::mount::is_rackfs_mount(&m.dir) || !matches!(m.child.try_wait(), Ok(None))
        });
        if !ok || !rackfs_fs::mount::is_rackfs_mount(&m.dir) {
            let _ = m.child.kill();
            return Err(std::fs::read_to_string(&m.log).unwrap_or_default());
        }
        Ok(m)
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: umount2 on a NUL-terminated path we mounted; MNT_DETACH never blocks.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        let _ = wait_for(Duration::from_secs(5), || {
            !matches!(self.child.try_wait(), Ok(None))
        });
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small deterministic random generator for workload tests (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let seed = self.next_u64();
        (0..n)
            .map(|i| (seed.wrapping_mul(i as u64 + 1) >> 24) as u8)
            .collect()
    }
}
