// A small markdown renderer that builds DOM nodes directly: text only ever enters the page through
// createTextNode, so model output can never become markup (there is no HTML parsing step to
// sanitise). Supported: paragraphs, #-headings, fenced code, `code`, **bold**, *italic*, bullet and
// numbered lists, pipe tables, and [links](https://...) to http(s) URLs only (anything else is
// shown as the literal text).
"use strict";
(function () {
  const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\([^)\s]+\))/g;

  function safeUrl(href) {
    try {
      const u = new URL(href);
      return (u.protocol === "http:" || u.protocol === "https:") ? u.href : null;
    } catch (e) {
      return null;
    }
  }

  function inline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      const s = m[0];
      let node;
      if (m[1]) {
        node = document.createElement("code");
        node.textContent = s.slice(1, -1);
      } else if (m[2]) {
        node = document.createElement("strong");
        inline(node, s.slice(2, -2));
      } else if (m[3]) {
        node = document.createElement("em");
        inline(node, s.slice(1, -1));
      } else {
        const close = s.indexOf("](");
        const label = s.slice(1, close), href = safeUrl(s.slice(close + 2, -1));
        if (href) {
          node = document.createElement("a");
          node.href = href;
          node.rel = "noopener noreferrer nofollow";
          node.target = "_blank";
          node.textContent = label;
        } else {
          node = document.createTextNode(s);
        }
      }
      parent.appendChild(node);
      last = m.index + s.length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function cells(line) {
    return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map(c => c.trim());
  }

  function render(text) {
    const frag = document.createDocumentFragment();
    const lines = String(text).split("\n");
    let i = 0, para = [];
    const flush = () => {
      if (para.length) {
        const p = document.createElement("p");
        inline(p, para.join("\n"));
        frag.appendChild(p);
        para = [];
      }
    };
    while (i < lines.length) {
      const line = lines[i];
      if (/^\s*```/.test(line)) {
        flush();
        const code = [];
        i++;
        while (i < lines.length && !/^\s*```/.test(lines[i])) code.push(lines[i++]);
        i++;
        const pre = document.createElement("pre"), c = document.createElement("code");
        c.textContent = code.join("\n");
        pre.appendChild(c);
        frag.appendChild(pre);
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      if (h) {
        flush();
        const el = document.createElement("h" + h[1].length);
        inline(el, h[2]);
        frag.appendChild(el);
        i++;
        continue;
      }
      if (/^\s*\|.*\|\s*$/.test(line) && i + 1 < lines.length && /^\s*\|?[\s:|-]+\|?\s*$/.test(lines[i + 1])
          && lines[i + 1].includes("-")) {
        flush();
        const table = document.createElement("table"), head = document.createElement("tr");
        for (const c of cells(line)) {
          const th = document.createElement("th");
          inline(th, c);
          head.appendChild(th);
        }
        table.appendChild(head);
        i += 2;
        while (i < lines.length && /^\s*\|.*\|\s*$/.test(lines[i])) {
          const tr = document.createElement("tr");
          for (const c of cells(lines[i++])) {
            const td = document.createElement("td");
            inline(td, c);
            tr.appendChild(td);
          }
          table.appendChild(tr);
        }
        frag.appendChild(table);
        continue;
      }
      const li = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (li) {
        flush();
        const ordered = /\d/.test(li[1]);
        const list = document.createElement(ordered ? "ol" : "ul");
        while (i < lines.length) {
          const m = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(lines[i]);
          if (!m || /\d/.test(m[1]) !== ordered) break;
          const item = document.createElement("li");
          inline(item, m[2]);
          list.appendChild(item);
          i++;
        }
        frag.appendChild(list);
        continue;
      }
      if (!line.trim()) flush(); else para.push(line);
      i++;
    }
    flush();
    return frag;
  }

  window.renderMarkdown = render;
})();
