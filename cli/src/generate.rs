//! `rackfs generate` (hidden): man pages and shell completions from the clap definitions, so
//! they never drift from the real flags. `scripts/install` writes them at install time; none
//! is kept in git.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

use crate::args::Cli;
use crate::error::CliError;

/// Writes `rackfs.1` and a page per (visible) subcommand into `dir`; returns `rackfs.1`'s path.
pub fn man(dir: &Path) -> Result<PathBuf, CliError> {
    let at = |err| CliError::Generate {
        path: dir.to_path_buf(),
        err,
    };
    std::fs::create_dir_all(dir).map_err(at)?;
    clap_mangen::generate_to(Cli::command(), dir).map_err(at)?;
    Ok(dir.join("rackfs.1"))
}

/// Writes the completion script of `shell` for `rackfs` into `dir`; returns its path
/// (`rackfs.bash`, `_rackfs` for zsh, `rackfs.fish`, ...).
pub fn completions(shell: Shell, dir: &Path) -> Result<PathBuf, CliError> {
    let at = |err| CliError::Generate {
        path: dir.to_path_buf(),
        err,
    };
    std::fs::create_dir_all(dir).map_err(at)?;
    clap_complete::generate_to(shell, &mut Cli::command(), "rackfs", dir).map_err(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_lines_are_consistent() {
        Cli::command().debug_assert();
        crate::args::Generate::command().debug_assert();
    }
}
