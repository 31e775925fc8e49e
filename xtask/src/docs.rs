//! `cargo xtask docs`, and the checks that keep README.md and docs/ whole: every relative link
//! leads to a file (and a heading, where it names one), and the text speaks of the project,
//! never of who worked on it when.

use anyhow::Result;

use crate::{cargo, run};

/// The generated pages are written by the unit test that checks them (blessed), so the page
/// and its check cannot come from two generators.
pub fn write() -> Result<()> {
    let mut cmd = cargo(None);
    cmd.args(["test", "--release", "-p", "tracerd", "--lib", "--", "--exact"])
        .arg("reference::tests::the_cli_reference_is_generated_from_the_code")
        .env("TRACERD_BLESS", "1");
    run(&mut cmd, "writing docs/reference/cli.md")?;
    println!("wrote docs/reference/cli.md");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use crate::root_dir;

    /// README.md, deploy/README.md and every page under docs/.
    fn pages() -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "md") {
                    out.push(path);
                }
            }
        }
        let root = root_dir();
        let mut out = vec![root.join("README.md"), root.join("deploy/README.md")];
        walk(&root.join("docs"), &mut out);
        out.sort();
        out
    }

    /// A heading's anchor as GitHub makes it: lower case, spaces to dashes, other punctuation gone.
    fn anchor(heading: &str) -> String {
        heading
            .trim()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                '-' | '_' => Some(c),
                c if c.is_alphanumeric() => Some(c.to_lowercase().next().unwrap_or(c)),
                _ => None,
            })
            .collect()
    }

    /// A page's lines outside code blocks.
    fn prose(text: &str) -> impl Iterator<Item = &str> {
        let mut in_code = false;
        text.lines().filter(move |line| {
            if line.starts_with("```") {
                in_code = !in_code;
                return false;
            }
            !in_code
        })
    }

    /// The headings of a page, outside code blocks.
    fn anchors(text: &str) -> Vec<String> {
        prose(text).filter(|l| l.starts_with('#')).map(|l| anchor(l.trim_start_matches('#'))).collect()
    }

    /// Every `](target)` of a page outside code blocks.
    fn links(text: &str) -> Vec<String> {
        prose(text)
            .flat_map(|line| line.split("](").skip(1))
            .filter_map(|part| part.find(')').map(|end| part[..end].to_owned()))
            .collect()
    }

    #[test]
    fn anchors_are_made_as_github_makes_them() {
        assert_eq!(anchor(" The API"), "the-api");
        assert_eq!(anchor(" `report --json`"), "report---json");
        assert_eq!(
            anchor(" Formats: exemplars and native histograms"),
            "formats-exemplars-and-native-histograms"
        );
    }

    #[test]
    fn every_relative_link_in_the_docs_leads_somewhere() {
        let mut broken = Vec::new();
        for page in pages() {
            let text = std::fs::read_to_string(&page).unwrap();
            for link in links(&text) {
                if link.contains("://") || link.starts_with("mailto:") {
                    continue;
                }
                let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
                let target = if path.is_empty() { page.clone() } else { page.parent().unwrap().join(path) };
                let ok = target.exists()
                    && (fragment.is_empty()
                        || target.is_dir()
                        || anchors(&std::fs::read_to_string(&target).unwrap_or_default())
                            .iter()
                            .any(|a| a == fragment));
                if !ok {
                    broken.push(format!("{}: ({link})", page.strip_prefix(root_dir()).unwrap().display()));
                }
            }
        }
        assert!(broken.is_empty(), "links that lead nowhere:\n{}", broken.join("\n"));
    }

    /// History lives in commit messages and dated journal notes, not in the documents.
    #[test]
    fn the_docs_speak_of_the_project_not_of_sessions() {
        let mut hits = Vec::new();
        for page in pages() {
            let text = std::fs::read_to_string(&page).unwrap();
            for (n, line) in text.lines().enumerate() {
                let lower = line.to_lowercase();
                let session_n = lower
                    .match_indices("session ")
                    .any(|(i, m)| lower[i + m.len()..].chars().next().is_some_and(|c| c.is_ascii_digit()));
                if lower.contains("this session") || lower.contains("previous session") || session_n {
                    hits.push(format!(
                        "{}:{}: {line}",
                        page.strip_prefix(root_dir()).unwrap().display(),
                        n + 1
                    ));
                }
            }
        }
        assert!(hits.is_empty(), "{}", hits.join("\n"));
    }
}
