//! etcd on loopback, for `rackfs up --etcd` and the tests: Debian's `etcd-server` started on
//! free ports, one member or several forming one cluster, with their data in a directory of
//! the caller's.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Coordinator, Etcd};

/// Why a local etcd did not start.
#[derive(Debug, thiserror::Error)]
pub enum EtcdStartError {
    #[error("cannot run {bin}: {err} (install Debian's etcd-server: apt-get install etcd-server)")]
    Spawn { bin: String, err: std::io::Error },
    #[error("cannot pick a free port: {0}")]
    Port(std::io::Error),
    #[error("etcd did not answer within {secs} s; its log: {log}")]
    NotReady { secs: u64, log: String },
}

/// One member: its process and client endpoint.
struct Member {
    child: Option<Child>,
    endpoint: String,
    log: PathBuf,
}

/// A running etcd cluster on loopback (its members are killed on drop).
pub struct EtcdServer {
    members: Vec<Member>,
}

fn free_port() -> Result<u16, EtcdStartError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(EtcdStartError::Port)?;
    Ok(l.local_addr().map_err(EtcdStartError::Port)?.port())
}

/// The etcd binary: `$RACKFS_ETCD`, else `etcd` on the path.
pub fn etcd_binary() -> String {
    std::env::var("RACKFS_ETCD").unwrap_or_else(|_| "etcd".into())
}

impl EtcdServer {
    /// One member with its data and log in `dir`; returns once it answers.
    pub fn start(dir: &Path) -> Result<EtcdServer, EtcdStartError> {
        Self::start_members(dir, 1)
    }

    /// A cluster of `n` members (data and logs in `dir`); returns once it answers.
    /// A port picked free can be taken by another process before etcd binds it: a start
    /// whose member exits at once is tried again on new ports (in a directory of its own).
    pub fn start_members(dir: &Path, n: usize) -> Result<EtcdServer, EtcdStartError> {
        let mut tries = 0;
        loop {
            let at = if tries == 0 {
                dir.to_path_buf()
            } else {
                dir.join(format!("retry{tries}"))
            };
            std::fs::create_dir_all(&at).map_err(EtcdStartError::Port)?;
            match Self::start_once(&at, n) {
                Err(EtcdStartError::NotReady { log, .. })
                    if tries < 3 && log.contains("address already in use") =>
                {
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    fn start_once(dir: &Path, n: usize) -> Result<EtcdServer, EtcdStartError> {
        let ports: Vec<(u16, u16)> = (0..n)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<Result<_, EtcdStartError>>()?;
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut s = EtcdServer {
            members: Vec::new(),
        };
        for (i, (client, peer)) in ports.into_iter().enumerate() {
            let m = spawn_member(dir, i, client, peer, &initial.join(","))?;
            s.members.push(m);
        }
        let probe = Etcd::new(&s.endpoints(), "probe", Duration::from_millis(500)).expect("valid");
        // Waiting for real etcd processes to answer: the host's time, not a simulation's (this
        // module starts processes; the coordinator's logic is `Local`'s and `Etcd`'s).
        let end = Instant::now() + Duration::from_secs(20);
        // An answer alone is not enough: another test's etcd may have taken a member's port
        // first (that member then exits), and answer for it. Each member's own log says it
        // serves its port.
        let serving = |s: &EtcdServer| {
            s.members.iter().all(|m| {
                let log = std::fs::read_to_string(&m.log).unwrap_or_default();
                log.lines()
                    .any(|l| l.contains("serving") && l.contains(&m.endpoint))
            })
        };
        while probe.get("ready").is_err() || !serving(&s) {
            let exited = s.members.iter_mut().any(|m| {
                m.child
                    .as_mut()
                    .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
            });
            if Instant::now() > end || exited {
                let log = s
                    .members
                    .iter()
                    .map(|m| std::fs::read_to_string(&m.log).unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(EtcdStartError::NotReady { secs: 20, log });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(s)
    }

    /// Every member's `host:port`, comma-separated (what `--etcd` takes).
    pub fn endpoints(&self) -> String {
        let e: Vec<&str> = self.members.iter().map(|m| m.endpoint.as_str()).collect();
        e.join(",")
    }

    /// Member `i`'s process id (0 once killed).
    pub fn pid(&self, i: usize) -> u32 {
        self.members[i].child.as_ref().map_or(0, Child::id)
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_member(
    dir: &Path,
    i: usize,
    client: u16,
    peer: u16,
    initial: &str,
) -> Result<Member, EtcdStartError> {
    let endpoint = format!("127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = dir.join(format!("etcd{i}.log"));
    let out = std::fs::File::create(&log).map_err(|err| EtcdStartError::Spawn {
        bin: log.display().to_string(),
        err,
    })?;
    let bin = etcd_binary();
    let mut cmd = Command::new(&bin);
    // SAFETY: the closure only calls prctl(2), which is async-signal-safe, between fork and
    // exec: etcd goes when the thread that started it does.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .arg(format!("--name=m{i}"))
        .arg(format!(
            "--data-dir={}",
            dir.join(format!("etcd{i}-data")).display()
        ))
        .arg(format!("--listen-client-urls=http://{endpoint}"))
        .arg(format!("--advertise-client-urls=http://{endpoint}"))
        .arg(format!("--listen-peer-urls={peer_url}"))
        .arg(format!("--initial-advertise-peer-urls={peer_url}"))
        .arg(format!("--initial-cluster={initial}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(out)
        .spawn()
        .map_err(|err| EtcdStartError::Spawn { bin, err })?;
    Ok(Member {
        child: Some(child),
        endpoint,
        log,
    })
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
