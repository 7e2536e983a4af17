//! The repository's Markdown stands on its own: every relative link resolves to a file inside the
//! repository, so a fresh clone has no dead or outward links.

use std::path::{Path, PathBuf};

use switchyard_e2e::process::workspace_root;

/// Folders that are build output, caches or tool state, not the repository's documents.
const SKIPPED: &[&str] = &[
    "target",
    ".cache",
    ".venv",
    ".git",
    "bench-results",
    "node_modules",
];

fn markdown_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if !SKIPPED.iter().any(|skip| name == *skip) {
                markdown_files(&path, found);
            }
        } else if path.extension().is_some_and(|ext| ext == "md") {
            found.push(path);
        }
    }
}

/// Targets of inline Markdown links `[text](target)` and images `![alt](target)`, code spans
/// and fenced blocks skipped.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans.
        let text: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            targets.push(target.to_owned());
            rest = &after[end..];
        }
    }
    targets
}

#[test]
fn every_markdown_link_resolves_inside_the_repository() {
    let root = workspace_root().canonicalize().unwrap();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("DESIGN.md")),
        "no DESIGN.md at the root"
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for target in link_targets(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
                || target.starts_with('#')
            {
                continue;
            }
            checked += 1;
            let path = target.split('#').next().unwrap_or("");
            let resolved = file.parent().unwrap().join(path);
            match resolved.canonicalize() {
                Ok(real) if real.starts_with(&root) => {}
                Ok(real) => broken.push(format!(
                    "{}: {target} leaves the repository ({})",
                    file.display(),
                    real.display()
                )),
                Err(_) => broken.push(format!("{}: {target} does not exist", file.display())),
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parser broken?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_parser_sees_links_and_skips_code() {
    let targets = link_targets(
        "See [design](DESIGN.md#routing) and ![plot](a.png).\n`[not](x.md)`\n```\n[no](y.md)\n```\n",
    );
    assert_eq!(targets, vec!["DESIGN.md#routing", "a.png"]);
}
