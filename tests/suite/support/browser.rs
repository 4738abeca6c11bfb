//! Headless Chromium for the dashboard test: Debian's `chromium`, which
//! `scripts/browser.sh` installs. Without it the test is skipped loudly
//! (and fails with `CI=true`).

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Chromium {
    binary: PathBuf,
}

/// The browser, or `None` after saying by name that `test` was skipped.
pub fn chromium(test: &str) -> Option<Chromium> {
    for candidate in ["chromium", "chromium-browser", "google-chrome"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {candidate}")])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        if let Some(path) = found.filter(|p| !p.is_empty()) {
            return Some(Chromium {
                binary: path.into(),
            });
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: no chromium (scripts/browser.sh installs it) and CI=true");
    }
    eprintln!("SKIPPED (no Chromium): {test}");
    None
}

impl Chromium {
    /// The flags this machine's closed network wants (no background
    /// connections, no updates), a fresh profile per run.
    fn command(&self, profile: &Path) -> Command {
        let mut command = Command::new(&self.binary);
        command.args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            // Timers and fetches run until the page has been idle this long
            // (virtual time: the page's 2 s refresh does not wait 2 s).
            "--virtual-time-budget=6000",
        ]);
        command.arg(format!(
            "--user-data-dir={}",
            profile.join("profile").display()
        ));
        command
    }

    /// The DOM after the page's scripts ran.
    pub fn dump_dom(&self, url: &str, dir: &Path) -> String {
        let out = self
            .command(dir)
            .arg("--dump-dom")
            .arg(url)
            .output()
            .expect("running chromium");
        assert!(
            out.status.success(),
            "chromium: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A screenshot of the page, saved in `dir`.
    pub fn screenshot(&self, url: &str, dir: &Path) -> PathBuf {
        let path = dir.join("dashboard.png");
        let out = self
            .command(dir)
            .arg(format!("--screenshot={}", path.display()))
            .arg("--window-size=1400,1800")
            .arg(url)
            .output()
            .expect("running chromium");
        assert!(
            out.status.success(),
            "chromium: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        path
    }
}

/// The `<tr …>…</tr>` whose text contains `marker`.
pub fn row<'a>(dom: &'a str, marker: &str) -> Option<&'a str> {
    let at = dom.find(marker)?;
    let start = dom[..at].rfind("<tr")?;
    let end = at + dom[at..].find("</tr>")? + 5;
    Some(&dom[start..end])
}

/// The text of the `<td …>` in `row` whose attributes contain `attribute`.
pub fn cell<'a>(row: &'a str, attribute: &str) -> Option<&'a str> {
    let at = row.find(attribute)?;
    let open_end = at + row[at..].find('>')? + 1;
    let close = open_end + row[open_end..].find("</td>")?;
    Some(&row[open_end..close])
}
