//! Memory-node processes: one node, or a cluster of them (node 0 the primary).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use rackfs_verbs::{QueuePair, Secret};

use crate::process::{bin_path, TempDir};

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
        Self::start_in(&[], "127.0.0.1:0", region, secret, extra)
    }

    /// A node listening on `listen`, started through the command `prefix` (e.g. `ip netns exec
    /// NS`, which execs the node in a network namespace, so the child is the node itself).
    pub fn start_in(
        prefix: &[&str],
        listen: &str,
        region: &str,
        secret: Secret,
        extra: &[&str],
    ) -> MemNodeProcess {
        let dir = TempDir::new("mn");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, secret.expose()).expect("write secret");
        let shm = dir.path().join("mn.sock");
        let stderr_log = dir.path().join("stderr.log");
        let mut cmd = match prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(bin_path("rackfs-memnode"));
                c
            }
            None => Command::new(bin_path("rackfs-memnode")),
        };
        let mut child = cmd
            .args(["--listen", listen, "--region", region, "--secret-file"])
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

/// A cluster of memory-node processes: node 0 is the primary, the others join it. On etcd
/// ([`TestCluster::on_etcd`]) it owns the etcd server too.
pub struct TestCluster {
    pub nodes: Vec<Option<MemNodeProcess>>,
    pub secret_file: PathBuf,
    secret: Secret,
    region: String,
    /// Each node's flags, to start it again.
    flags: Vec<Vec<String>>,
    /// Each node's logs of its earlier runs (a failure's message shows them whole).
    earlier: Vec<String>,
    pub etcd: Option<rackfs_coord::EtcdServer>,
    etcd_dir: Option<TempDir>,
    _dir: TempDir,
}

impl TestCluster {
    /// `n` nodes of `region` each; freed file data is quarantined for 200 ms.
    pub fn start(n: usize, region: &str) -> TestCluster {
        Self::start_with(n, region, &[])
    }

    /// [`TestCluster::start`] with more `rackfs-memnode` flags for every node.
    pub fn start_with(n: usize, region: &str, extra: &[&str]) -> TestCluster {
        Self::launch(n, region, extra, None)
    }

    /// [`TestCluster::start_with`] with the cluster map, leases and election on a real etcd
    /// (started here, on loopback), as cluster `test`.
    pub fn on_etcd(n: usize, region: &str, extra: &[&str]) -> TestCluster {
        Self::on_etcd_members(1, n, region, extra)
    }

    /// [`TestCluster::on_etcd`] on an etcd cluster of `members` members.
    pub fn on_etcd_members(members: usize, n: usize, region: &str, extra: &[&str]) -> TestCluster {
        let dir = TempDir::in_memory("etcd");
        let etcd = rackfs_coord::EtcdServer::start_members(dir.path(), members)
            .unwrap_or_else(|e| panic!("{e}"));
        let endpoint = etcd.endpoints();
        let flags = [extra, &["--etcd", &endpoint, "--cluster", "test"]].concat();
        let mut c = Self::launch(n, region, &flags, Some(etcd));
        c.etcd_dir = Some(dir);
        c
    }

    fn launch(
        n: usize,
        region: &str,
        extra: &[&str],
        etcd: Option<rackfs_coord::EtcdServer>,
    ) -> TestCluster {
        let secret = Secret::generate();
        let dir = TempDir::new("cluster");
        let secret_file = dir.path().join("secret");
        std::fs::write(&secret_file, secret.expose()).expect("write secret");
        let mut c = TestCluster {
            nodes: Vec::new(),
            secret_file,
            secret,
            region: region.into(),
            flags: Vec::new(),
            earlier: Vec::new(),
            etcd,
            etcd_dir: None,
            _dir: dir,
        };
        for i in 0..n {
            let id = i.to_string();
            let name = format!("mn{i}");
            let mut f: Vec<String> = match i {
                0 => vec!["--primary".into()],
                _ => vec!["--join".into(), c.addr()],
            };
            f.extend(
                ["--node-id", &id, "--name", &name, "--quarantine-ms", "200"].map(String::from),
            );
            f.extend(extra.iter().map(|s| s.to_string()));
            c.flags.push(f);
            c.nodes.push(None);
            c.earlier.push(String::new());
            c.restart(i);
        }
        c
    }

    /// Starts node `i` (again) with its flags: a new process, with empty memory.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        let flags: Vec<&str> = self.flags[i].iter().map(String::as_str).collect();
        self.nodes[i] = Some(MemNodeProcess::start_with(
            &self.region,
            self.secret.clone(),
            &flags,
        ));
    }

    /// Starts one more node with exactly `flags` (besides its listeners, region and the
    /// cluster's secret, which every node gets); returns its index, to restart or kill it.
    pub fn add(&mut self, flags: &[&str]) -> usize {
        self.flags
            .push(flags.iter().map(|s| s.to_string()).collect());
        self.nodes.push(None);
        self.earlier.push(String::new());
        let i = self.nodes.len() - 1;
        self.restart(i);
        i
    }

    /// The flags node `i` is started with (its command line, but for listeners, region and
    /// secret).
    pub fn flags(&self, i: usize) -> &[String] {
        &self.flags[i]
    }

    /// The etcd client endpoints, comma-separated (clusters on etcd only).
    pub fn etcd_endpoints(&self) -> String {
        self.etcd.as_ref().expect("a cluster on etcd").endpoints()
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
            self.earlier[i] += &n.stderr();
        }
    }

    /// Node `i`'s log over all its runs.
    pub fn log(&self, i: usize) -> String {
        let now = self.nodes[i]
            .as_ref()
            .map(|n| n.stderr())
            .unwrap_or_default();
        format!("{}{now}", self.earlier[i])
    }
}
