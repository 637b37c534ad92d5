//! A process that takes `fcntl` and `flock` locks on command, for the record-lock scenarios:
//! it reads one command per line on stdin and answers one line on stdout per command (a
//! blocking command answers when it returns). Commands:
//!
//! * `open PATH` — opens (creating) a descriptor; later commands use the newest one
//! * `use N` — use descriptor number N (0 = first opened)
//! * `close` — closes the descriptor in use
//! * `setlk R|W|U START LEN`, `setlkw R|W|U START LEN` — `F_SETLK` / `F_SETLKW`
//! * `getlk R|W START LEN` — `F_GETLK`: `unlocked` or `R|W START LEN PID`
//! * `ofd-setlk R|W|U START LEN`, `ofd-setlkw ...` — open file description locks
//! * `flock sh|ex|un [nb]`
//! * `alarm MS` — a `SIGALRM` (handler without `SA_RESTART`) after MS ms
//! * `fork-hold R|W START LEN` — a child takes the lock and holds it until stdin closes
//! * `pid`, `exit`
//!
//! Answers are `ok` or the errno's name (`EAGAIN`, `EACCES`, `EINTR`, ...).

use std::ffi::CString;
use std::io::{BufRead, Write};
use std::os::fd::RawFd;

extern "C" fn on_alarm(_: libc::c_int) {}

fn errno_name() -> String {
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    match e {
        libc::EAGAIN => "EAGAIN".into(),
        libc::EACCES => "EACCES".into(),
        libc::EINTR => "EINTR".into(),
        libc::EBADF => "EBADF".into(),
        libc::EINVAL => "EINVAL".into(),
        libc::EDEADLK => "EDEADLK".into(),
        libc::ENOLCK => "ENOLCK".into(),
        other => format!("errno {other}"),
    }
}

fn lock_type(s: &str) -> libc::c_short {
    (match s {
        "R" => libc::F_RDLCK,
        "W" => libc::F_WRLCK,
        _ => libc::F_UNLCK,
    }) as libc::c_short
}

fn flock_of(typ: &str, start: &str, len: &str) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = lock_type(typ);
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start.parse().expect("start");
    fl.l_len = len.parse().expect("len");
    fl
}

fn fcntl_lock(fd: RawFd, cmd: libc::c_int, fl: &mut libc::flock) -> String {
    // SAFETY: fd is a descriptor of ours and fl a valid flock.
    if unsafe { libc::fcntl(fd, cmd, fl as *mut libc::flock) } == 0 {
        "ok".into()
    } else {
        errno_name()
    }
}

fn main() {
    let mut fds: Vec<RawFd> = Vec::new();
    let mut cur: RawFd = -1;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let answer = match w.as_slice() {
            ["open", path] => {
                let p = CString::new(*path).expect("path");
                // SAFETY: p is NUL-terminated.
                let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o644) };
                if fd < 0 {
                    errno_name()
                } else {
                    fds.push(fd);
                    cur = fd;
                    "ok".into()
                }
            }
            ["use", n] => {
                cur = fds[n.parse::<usize>().expect("n")];
                "ok".into()
            }
            ["close"] => {
                // SAFETY: closing a descriptor of ours.
                unsafe { libc::close(cur) };
                "ok".into()
            }
            ["setlk", t, s, l] => fcntl_lock(cur, libc::F_SETLK, &mut flock_of(t, s, l)),
            ["setlkw", t, s, l] => fcntl_lock(cur, libc::F_SETLKW, &mut flock_of(t, s, l)),
            ["ofd-setlk", t, s, l] => fcntl_lock(cur, libc::F_OFD_SETLK, &mut flock_of(t, s, l)),
            ["ofd-setlkw", t, s, l] => fcntl_lock(cur, libc::F_OFD_SETLKW, &mut flock_of(t, s, l)),
            ["getlk", t, s, l] => {
                let mut fl = flock_of(t, s, l);
                match fcntl_lock(cur, libc::F_GETLK, &mut fl).as_str() {
                    "ok" if fl.l_type == libc::F_UNLCK as libc::c_short => "unlocked".into(),
                    "ok" => format!(
                        "{} {} {} {}",
                        if fl.l_type == libc::F_WRLCK as libc::c_short {
                            "W"
                        } else {
                            "R"
                        },
                        fl.l_start,
                        fl.l_len,
                        fl.l_pid
                    ),
                    e => e.into(),
                }
            }
            ["flock", op, rest @ ..] => {
                let mut how = match *op {
                    "sh" => libc::LOCK_SH,
                    "ex" => libc::LOCK_EX,
                    _ => libc::LOCK_UN,
                };
                if rest == ["nb"] {
                    how |= libc::LOCK_NB;
                }
                // SAFETY: a plain syscall on our descriptor.
                if unsafe { libc::flock(cur, how) } == 0 {
                    "ok".into()
                } else {
                    errno_name()
                }
            }
            ["alarm", ms] => {
                // SAFETY: installing a handler that does nothing, without SA_RESTART.
                unsafe {
                    let mut sa: libc::sigaction = std::mem::zeroed();
                    sa.sa_sigaction = on_alarm as *const () as usize;
                    libc::sigaction(libc::SIGALRM, &sa, std::ptr::null_mut());
                    let ms: i64 = ms.parse().expect("ms");
                    let t = libc::itimerval {
                        it_interval: libc::timeval {
                            tv_sec: 0,
                            tv_usec: 0,
                        },
                        it_value: libc::timeval {
                            tv_sec: ms / 1000,
                            tv_usec: (ms % 1000) * 1000,
                        },
                    };
                    libc::setitimer(libc::ITIMER_REAL, &t, std::ptr::null_mut());
                }
                "ok".into()
            }
            ["fork-hold", t, s, l] => {
                let fd = cur;
                let mut fl = flock_of(t, s, l);
                // SAFETY: the child only locks, says so, and waits for stdin to close.
                match unsafe { libc::fork() } {
                    0 => {
                        let r = fcntl_lock(fd, libc::F_SETLK, &mut fl);
                        println!("child {r}");
                        let _ = std::io::stdout().flush();
                        let mut buf = [0u8; 1];
                        // SAFETY: reading our stdin until it closes.
                        while unsafe { libc::read(0, buf.as_mut_ptr().cast(), 1) } > 0 {}
                        // SAFETY: leaving the child without running the parent's destructors.
                        unsafe { libc::_exit(0) }
                    }
                    -1 => errno_name(),
                    _ => continue, // the child answers
                }
            }
            ["pid"] => std::process::id().to_string(),
            ["exit"] => break,
            _ => format!("bad command {line:?}"),
        };
        writeln!(out, "{answer}").expect("stdout");
        out.flush().expect("stdout");
    }
}
