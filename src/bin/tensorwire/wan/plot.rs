//! `--plot FILE.svg`: the WAN table as a grouped bar chart, written as
//! plain SVG by hand (no plotting crate: one chart type does not justify
//! the dependency). One group per transport and data kind, one bar per
//! compression, bar height the speed-up over `none` (1.0 line drawn).

use std::fmt::Write;

use super::Row;

const COLOURS: [&str; 8] = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The chart of `rows`, titled with the link.
pub fn svg(rows: &[Row], link: &str) -> String {
    let mut groups: Vec<(String, String)> = vec![];
    let mut comps: Vec<String> = vec![];
    for r in rows {
        if !groups.iter().any(|(t, d)| *t == r.transport && *d == r.data) {
            groups.push((r.transport.clone(), r.data.clone()));
        }
        if !comps.contains(&r.compress) {
            comps.push(r.compress.clone());
        }
    }
    let bar = 14.0;
    let gap = 18.0;
    let group_w = bar * comps.len() as f64 + gap;
    let (left, top, plot_h, bottom) = (60.0, 40.0, 300.0, 150.0);
    let width = left + group_w * groups.len() as f64 + 160.0;
    let height = top + plot_h + bottom;
    let ymax = rows.iter().map(|r| r.speedup_vs_none).fold(1.0f64, f64::max).min(100.0) * 1.1;
    let y = |v: f64| top + plot_h - (v.min(ymax) / ymax) * plot_h;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="11">
<rect width="100%" height="100%" fill="white"/>
<text x="{left}" y="20" font-size="14">tensorwire bench --link {} : speed-up over uncompressed</text>
"#,
        esc(link)
    );
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.0}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end">{v:.1}x</text>"##,
            width - 160.0,
            y(v),
            y(v),
            left - 5.0,
            y(v) + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<line x1="{left}" x2="{:.0}" y1="{:.1}" y2="{:.1}" stroke="black" stroke-dasharray="4 3"/>"#,
        width - 160.0,
        y(1.0),
        y(1.0)
    );
    for (g, (t, d)) in groups.iter().enumerate() {
        let x0 = left + gap / 2.0 + g as f64 * group_w;
        for (c, comp) in comps.iter().enumerate() {
            if let Some(r) = rows.iter().find(|r| r.transport == *t && r.data == *d && r.compress == *comp) {
                let x = x0 + c as f64 * bar;
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {} {}: {:.2}x, ratio {:.2}, {:.2} s</title></rect>"#,
                    y(r.speedup_vs_none),
                    bar - 1.0,
                    top + plot_h - y(r.speedup_vs_none),
                    COLOURS[c % COLOURS.len()],
                    esc(t),
                    esc(d),
                    esc(comp),
                    r.speedup_vs_none,
                    r.compression_ratio,
                    r.seconds
                );
            }
        }
        let cx = x0 + bar * comps.len() as f64 / 2.0;
        let ly = top + plot_h + 12.0;
        let _ = writeln!(s, r#"<text transform="translate({cx:.1},{ly:.1}) rotate(45)">{} {}</text>"#, esc(t), esc(d));
    }
    for (c, comp) in comps.iter().enumerate() {
        let ly = top + 14.0 * c as f64;
        let lx = width - 150.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.0}" y="{ly:.0}" width="10" height="10" fill="{}"/><text x="{:.0}" y="{:.0}">{}</text>"#,
            COLOURS[c % COLOURS.len()],
            lx + 14.0,
            ly + 9.0,
            esc(comp)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_one_bar_per_row_and_a_legend() {
        let r = |t: &str, c: &str, sp: f64| Row {
            transport: t.into(),
            data: "bf16-trained".into(),
            compress: c.into(),
            bytes: 1,
            seconds: 1.0,
            wire_bytes: 1,
            compression_ratio: 1.0,
            speedup_vs_none: sp,
            link_utilisation: 0.9,
        };
        let rows = [r("tcp", "none", 1.0), r("tcp", "planes", 1.4), r("quic-bbr", "none", 1.0)];
        let s = svg(&rows, "100mbit,40ms,0%");
        assert_eq!(s.matches("<title>").count(), 3);
        assert!(s.contains(">planes</text>") && s.starts_with("<svg") && s.ends_with("</svg>\n"));
    }
}
