//! Fencing a mount whose lease expired: this node executes nothing more it sends.
//!
//! Every data connection (tcp verbs, shm, rdma) a client opens under a fence token
//! (`rackfs_verbs::wire::Hello::fence`: a mount's session on the primary) is registered here for
//! as long as it lives. [`Fences::fence`], asked by the primary when the mount's lease runs out,
//! marks the token fenced (new connections under it are refused at the handshake) and stops
//! each live connection:
//! * tcp: its `stop` flag is set (the NIC thread executes no batch after reading it) and its
//!   socket shut down;
//! * shm: the client fences itself through its counter block
//!   (`rackfs_verbs::shm::fence_client`); a client stopped *inside* a batch cannot, and its
//!   process is killed (`SIGKILL` through a pidfd taken when it connected, so never another
//!   process) and waited for;
//! * rdma: its socket is shut down, which destroys its queue pair.
//!
//! `fence` returns once every connection of the token has ended: from then on nothing the mount
//! sent before, or sends later, lands in this node's memory.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Bell, Mutex, SharedClock};
use rackfs_verbs::Region;
use tracing::{info, warn};

/// How long an shm client may stay inside one batch once fenced before its process is killed.
const SHM_BATCH_WAIT: Duration = Duration::from_millis(500);

/// How a connection is stopped when its token is fenced.
pub enum Stop {
    /// A tcp verbs or rdma connection: its socket (a duplicate) is shut down.
    Socket(OwnedFd),
    /// An shm client: its counter block, its process (if known) and its liveness socket.
    Shm {
        block: Arc<Region>,
        process: Option<Process>,
        socket: OwnedFd,
    },
}

/// A client process, held by pidfd so a signal never reaches a process that reused its pid.
pub struct Process {
    pid: i32,
    pidfd: OwnedFd,
}

impl Process {
    /// The process at the other end of Unix socket `sock` (`None` if the kernel will not say).
    pub fn of_peer(sock: &impl AsRawFd) -> Option<Process> {
        Self::open(Self::peer_pid(sock)?)
    }

    fn peer_pid(sock: &impl AsRawFd) -> Option<i32> {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt(SO_PEERCRED) writes at most `len` bytes into `cred`, a live local.
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        (r == 0 && cred.pid > 0).then_some(cred.pid)
    }

    /// Process `pid`, held by a pidfd from now on.
    pub fn open(pid: i32) -> Option<Process> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return None;
        }
        Some(Process {
            pid,
            // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        })
    }

    /// Kills the process and waits (at most `wait`) until it has exited.
    fn kill(&self, wait: Duration) -> bool {
        // SAFETY: pidfd_send_signal on a pidfd we own; no siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH) {
            return false;
        }
        // A pidfd polls readable once its process has exited.
        let mut pfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd we own.
        unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as i32) == 1 }
    }
}

fn shutdown(fd: &OwnedFd) {
    // SAFETY: shutdown(2) on a socket descriptor we own; it wakes the connection's thread.
    unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
}

struct Conn {
    token: u64,
    stop: Arc<AtomicBool>,
    how: Option<Stop>,
}

#[derive(Default)]
struct State {
    fenced: HashSet<u64>,
    conns: HashMap<u64, Conn>,
    next: u64,
}

/// The fenced tokens and the live fenceable connections of this node (see the module docs).
pub struct Fences {
    state: Mutex<State>,
    ended: Bell,
    /// The node's clock: how long a fence waits.
    clock: SharedClock,
}

/// A registered connection; dropping it (when the connection ends) unregisters it.
pub struct Registered<'a> {
    fences: &'a Fences,
    id: u64,
    /// Set when the connection's token is fenced: execute nothing more.
    pub stop: Arc<AtomicBool>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.fences
            .state
            .lock()
            .expect("fences lock")
            .conns
            .remove(&self.id);
        self.fences.ended.notify_all();
    }
}

/// What fencing a token did on this node.
#[derive(Debug, Default)]
pub struct Fenced {
    pub connections: usize,
    /// Processes killed because they were stopped inside an shm batch.
    pub killed: Vec<i32>,
}

impl Fences {
    /// Nothing fenced, no connection yet; waits timed on `clock` (the node's).
    pub fn new(clock: SharedClock) -> Fences {
        Fences {
            state: Mutex::default(),
            ended: Bell::new(),
            clock,
        }
    }

    pub fn is_fenced(&self, token: u64) -> bool {
        token != 0
            && self
                .state
                .lock()
                .expect("fences lock")
                .fenced
                .contains(&token)
    }

    /// Registers a connection opened under `token` (0: not fenceable: nothing is kept);
    /// `None` if the token is fenced (the connection must end at once).
    pub fn register(&self, token: u64, how: Stop) -> Option<Registered<'_>> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut st = self.state.lock().expect("fences lock");
        if token != 0 && st.fenced.contains(&token) {
            return None;
        }
        st.next += 1;
        let id = st.next;
        if token != 0 {
            st.conns.insert(
                id,
                Conn {
                    token,
                    stop: stop.clone(),
                    how: Some(how),
                },
            );
        }
        Some(Registered {
            fences: self,
            id,
            stop,
        })
    }

    /// Fences every token below `first` that has a connection here (an earlier primary's
    /// sessions, once a new primary took over), waiting at most `wait` for each.
    pub fn fence_below(&self, first: u64, wait: Duration) {
        let tokens: HashSet<u64> = self
            .state
            .lock()
            .expect("fences lock")
            .conns
            .values()
            .map(|c| c.token)
            .filter(|&t| t < first)
            .collect();
        for t in tokens {
            if let Err(why) = self.fence(t, wait) {
                warn!(token = t, %why, "cannot fence a session of the old primary");
            }
        }
    }

    /// Fences `token` (see the module docs); waits at most `wait` for its connections to end.
    pub fn fence(&self, token: u64, wait: Duration) -> Result<Fenced, String> {
        let started = self.clock.now();
        let victims: Vec<Stop> = {
            let mut st = self.state.lock().expect("fences lock");
            st.fenced.insert(token);
            st.conns
                .values_mut()
                .filter(|c| c.token == token)
                .filter_map(|c| {
                    c.stop.store(true, Ordering::SeqCst);
                    c.how.take()
                })
                .collect()
        };
        let mut done = Fenced {
            connections: victims.len(),
            ..Fenced::default()
        };
        for how in victims {
            match how {
                Stop::Socket(fd) => shutdown(&fd),
                Stop::Shm {
                    block,
                    process,
                    socket,
                } => {
                    if !rackfs_verbs::shm::fence_client(&block, SHM_BATCH_WAIT) {
                        let Some(p) = process else {
                            return Err("an shm client stopped inside a batch, and its process \
                                        is unknown: it cannot be fenced"
                                .into());
                        };
                        warn!(
                            pid = p.pid,
                            token,
                            "a fenced shm client is stopped inside a batch: killing its process"
                        );
                        if !p.kill(wait) {
                            return Err(format!(
                                "an shm client (pid {}) stopped inside a batch and could not be \
                                 killed",
                                p.pid
                            ));
                        }
                        done.killed.push(p.pid);
                    }
                    shutdown(&socket);
                }
            }
        }
        let mut st = self.state.lock().expect("fences lock");
        while st.conns.values().any(|c| c.token == token) {
            let left = wait.saturating_sub(self.clock.now().saturating_sub(started));
            if left.is_zero() {
                return Err(format!(
                    "{} connections of the fenced mount did not end within {wait:?}",
                    st.conns.values().filter(|c| c.token == token).count()
                ));
            }
            st = self.ended.wait_timeout(st, left).0;
        }
        info!(token, connections = done.connections, killed = ?done.killed, took = ?self.clock.now().saturating_sub(started), "mount fenced on this node");
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_clock::{Clock, SystemClock};
    use rackfs_verbs::shm::BUSY_WORD;
    use rackfs_verbs::Access;
    use std::os::unix::net::UnixStream;
    use std::process::Command;

    /// Fences on the host's clock (their waits are real).
    fn fences() -> Fences {
        Fences::new(Arc::new(SystemClock::new()))
    }

    fn shm_stop(busy: u64, process: Option<Process>) -> (Stop, Arc<Region>, UnixStream) {
        let block = Arc::new(Region::create_memfd("t", 4096, 0, Access::ALL).unwrap());
        block.store(BUSY_WORD, busy).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let stop = Stop::Shm {
            block: block.clone(),
            process,
            socket: ours.into(),
        };
        (stop, block, theirs)
    }

    #[test]
    fn an_idle_shm_client_fences_itself_and_new_connections_are_refused() {
        let f = fences();
        let (stop, block, _peer) = shm_stop(0, None);
        let reg = f.register(9, stop).unwrap();
        let done = std::thread::scope(|s| {
            s.spawn(move || {
                // The connection's thread: it ends soon after its socket is shut down.
                SystemClock::new().sleep(Duration::from_millis(50));
                drop(reg);
            });
            f.fence(9, Duration::from_secs(5)).unwrap()
        });
        assert_eq!((done.connections, done.killed.len()), (1, 0));
        assert_eq!(block.load(rackfs_verbs::shm::FENCE_WORD).unwrap(), 1);
        assert!(f.is_fenced(9) && !f.is_fenced(8));
        assert!(f
            .register(9, Stop::Socket(shm_stop(0, None).2.into()))
            .is_none());
        assert!(f
            .register(0, Stop::Socket(shm_stop(0, None).2.into()))
            .is_some());
    }

    #[test]
    fn an_shm_client_stopped_inside_a_batch_is_killed() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let process = Process::open(child.id() as i32).unwrap();
        let f = fences();
        let (stop, _block, _peer) = shm_stop(1, Some(process));
        let reg = f.register(5, stop).unwrap();
        let fences = &f;
        std::thread::scope(|s| {
            let fencing = s.spawn(move || fences.fence(5, Duration::from_secs(5)));
            // The connection ends once its socket is shut down (after the kill).
            let clock = SystemClock::new();
            while !reg.stop.load(Ordering::SeqCst) {
                clock.sleep(Duration::from_millis(1));
            }
            clock.sleep(Duration::from_millis(700));
            drop(reg);
            let done = fencing.join().unwrap().unwrap();
            assert_eq!(done.killed, vec![child.id() as i32]);
        });
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_connection_that_does_not_end_fails_the_fence() {
        let f = fences();
        let (stop, _block, _peer) = shm_stop(0, None);
        let _reg = f.register(3, stop).unwrap();
        let err = f.fence(3, Duration::from_millis(100)).unwrap_err();
        assert!(err.contains("did not end"), "{err}");
    }
}
