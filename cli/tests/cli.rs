//! The `rackfs` binary as a shell sees it: quiet on a closed pipe, clear errors on stderr, and
//! the man pages and completions it generates for packaging.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const RACKFS: &str = env!("CARGO_BIN_EXE_rackfs");

/// A pipe whose reader is already closed: every write to the other end fails with EPIPE.
fn widowed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array it is given, which has room.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just made by pipe2 and nothing else owns them.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(reader);
    writer
}

/// Runs `rackfs ARGS` with stdout a pipe nobody reads; stderr is captured.
fn into_closed_pipe(args: &[&str]) -> Output {
    Command::new(RACKFS)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(widowed_pipe()))
        .stderr(Stdio::piped())
        .output()
        .expect("run rackfs")
}

fn rackfs(args: &[&str]) -> Output {
    Command::new(RACKFS)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run rackfs")
}

fn assert_quiet_success(args: &[&str], out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "rackfs {args:?} into a closed pipe: {} ({err})",
        out.status
    );
    assert!(!err.contains("panicked"), "rackfs {args:?}: {err}");
    assert!(!err.contains("Broken pipe"), "rackfs {args:?}: {err}");
}

/// A private scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("rackfs-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch dir");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A secret file for `--secret-file` (the secret's contents do not matter: nothing answers).
fn secret_in(dir: &Path) -> PathBuf {
    let f = dir.join("secret");
    std::fs::write(&f, "0123456789abcdef0123456789abcdef").unwrap();
    f
}

/// `rackfs status | head -1`: the reader leaves after a line; the command ends quietly, 0.
#[test]
fn status_into_a_closed_pipe_exits_0_without_a_panic() {
    let out = into_closed_pipe(&["status"]);
    assert_quiet_success(&["status"], &out);
    // The same for a cluster that is not there: stdout failed first, so there is nothing left
    // to report.
    let dir = Scratch::new("status-pipe");
    let secret = secret_in(&dir.0);
    let args = [
        "status",
        "--cluster",
        "127.0.0.1:1",
        "--secret-file",
        secret.to_str().unwrap(),
    ];
    assert_quiet_success(&args, &into_closed_pipe(&args));
}

/// With a reader, a cluster that does not answer is an error on stderr that names it, not a
/// panic, and status 1.
#[test]
fn status_of_a_stopped_cluster_names_it_on_stderr() {
    let dir = Scratch::new("status-stopped");
    let secret = secret_in(&dir.0);
    let out = rackfs(&[
        "status",
        "--cluster",
        "127.0.0.1:1",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rackfs: cluster 127.0.0.1:1:") && err.contains("connect"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("mounts:"));
    // A missing secret file says which.
    let out = rackfs(&[
        "status",
        "--cluster",
        "127.0.0.1:1",
        "--secret-file",
        "/nonexistent/rackfs-secret",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/rackfs-secret"), "{err}");
    // `down` of what was never up: an error, no panic.
    let out = rackfs(&["down", dir.0.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no RackFS"), "{err}");
}

/// Help and version (clap's own printing) and `generate`'s report: quiet on a closed pipe.
#[test]
fn help_and_version_into_a_closed_pipe_exit_0() {
    for args in [
        &["--help"][..],
        &["--version"],
        &["status", "--help"],
        &["up", "--help"],
        &["qos", "set", "--help"],
        &["generate", "--help"],
    ] {
        assert_quiet_success(args, &into_closed_pipe(args));
    }
    let dir = Scratch::new("gen-pipe");
    let args = ["generate", "man", dir.0.to_str().unwrap()];
    assert_quiet_success(&args, &into_closed_pipe(&args));
}

/// `generate` is for packaging: it works, but operators' help does not offer it.
#[test]
fn help_does_not_offer_generate() {
    let out = rackfs(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("status") && !help.contains("generate"),
        "{help}"
    );
}

/// The man page names every subcommand; the bash completion completes `status`; zsh and fish
/// get theirs. None of them mentions the packaging-only `generate`.
#[test]
fn generate_writes_the_man_pages_and_completions() {
    let dir = Scratch::new("gen");
    let d = dir.0.to_str().unwrap();
    let out = rackfs(&["generate", "man", d]);
    assert!(out.status.success(), "{out:?}");
    let page = std::fs::read_to_string(dir.0.join("rackfs.1")).expect("rackfs.1");
    assert!(
        page.starts_with(".ie") || page.contains(".TH rackfs 1"),
        "{page}"
    );
    for sub in ["up", "down", "mount", "qos", "status"] {
        assert!(
            page.contains(&format!("rackfs\\-{sub}(1)")),
            "{sub}: {page}"
        );
        assert!(
            dir.0.join(format!("rackfs-{sub}.1")).exists(),
            "rackfs-{sub}.1"
        );
    }
    assert!(!page.contains("generate"), "{page}");

    for (shell, file) in [
        ("bash", "rackfs.bash"),
        ("zsh", "_rackfs"),
        ("fish", "rackfs.fish"),
    ] {
        let out = rackfs(&["generate", "completions", shell, d]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = std::fs::read_to_string(dir.0.join(file)).expect(file);
        assert!(script.contains("status"), "{shell}: {script}");
        assert!(!script.contains("generate"), "{shell}: {script}");
    }
    let out = rackfs(&["generate", "completions", "tcsh", d]);
    assert!(!out.status.success(), "an unknown shell is refused");
}
