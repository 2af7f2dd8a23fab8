/* attnroll viewer: draws the maps carried in #attnroll-data. Plain JavaScript, no library, no network. */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("attnroll-data").textContent);
  var app = document.getElementById("attnroll-app");
  var LAYERS = DATA.layers || 0;
  var S = { method: DATA.methods[0], layer: LAYERS, cmap: "heat", scale: "max", opacity: 0.6,
            outline: true, smooth: true };
  var views = [];          // every drawn panel: {update()}
  var CHUNK = 512;         // tokens rendered per step

  // ------------------------------------------------------------------ helpers
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function fmt(v) { return (v === 0 ? "0" : Number(v).toPrecision(4)); }
  function later(fn) { setTimeout(fn, 0); }

  // Packed rows (see quant.py): decoded on first use, one row at a time.
  var packs = new WeakMap();
  function rows(p) {
    var d = packs.get(p);
    if (d) return d;
    var s = atob(p.data), u8 = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) u8[i] = s.charCodeAt(i);
    var q = p.float ? new Float32Array(u8.buffer) : p.bits === 8 ? u8 : new Uint16Array(u8.buffer);
    var Q = p.bits === 8 ? 255 : 65535, done = [];
    d = { n: p.n, count: p.a.length, row: function (r) {
      if (done[r]) return done[r];
      var out = new Float64Array(p.n), a = p.a[r], signed = p.s[r], off = r * p.n;
      for (var j = 0; j < p.n; j++) {
        if (p.float) { out[j] = q[off + j]; continue; }
        var x = signed ? 2 * q[off + j] / (Q - 1) - 1 : q[off + j] / Q;
        out[j] = a * x * Math.abs(x);
      }
      done[r] = out;
      return out;
    } };
    packs.set(p, d);
    return d;
  }

  // ------------------------------------------------------------------ colour
  var ANCHORS = {
    heat: [[0, 0, 0], [120, 0, 10], [220, 40, 0], [255, 150, 0], [255, 240, 150]],
    jet: [[0, 0, 140], [0, 90, 255], [0, 225, 225], [235, 235, 0], [255, 60, 0], [130, 0, 0]],
    bgy: [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
    grey: [[0, 0, 0], [255, 255, 255]],
    diverging: [[40, 90, 220], [255, 255, 255], [215, 40, 40]]
  };
  var LUTS = {};
  function lut(name) {
    if (LUTS[name]) return LUTS[name];
    var a = ANCHORS[name], out = new Uint8Array(256 * 3);
    for (var i = 0; i < 256; i++) {
      var x = i / 255 * (a.length - 1), k = Math.min(Math.floor(x), a.length - 2), f = x - k;
      for (var c = 0; c < 3; c++) out[i * 3 + c] = Math.round(a[k][c] + (a[k + 1][c] - a[k][c]) * f);
    }
    return (LUTS[name] = out);
  }
  // The colour scale of one map: t in [0, 1] (or [-1, 1] for signed maps) for each value.
  function scaleOf(values, signed, skip, shared) {
    var lo = Infinity, hi = -Infinity, list = shared || [values];
    for (var r = 0; r < list.length; r++) {
      var v = list[r];
      for (var j = 0; j < v.length; j++) {
        if (skip && skip.has(j)) continue;
        if (v[j] < lo) lo = v[j];
        if (v[j] > hi) hi = v[j];
      }
    }
    if (lo === Infinity) { lo = 0; hi = 0; }
    if (signed) { var a = Math.max(Math.abs(lo), Math.abs(hi)); return { signed: true, lo: -a, hi: a }; }
    if (S.scale === "minmax") return { lo: lo, hi: hi };
    if (S.scale === "p99") hi = percentile(list, skip, 0.99);
    return { lo: 0, hi: Math.max(hi, 0) };
  }
  // The q-quantile of the values (skipped units left out): a scale that one dominant unit cannot wash out.
  function percentile(list, skip, q) {
    var all = [];
    list.forEach(function (v) { for (var j = 0; j < v.length; j++) if (!(skip && skip.has(j))) all.push(v[j]); });
    if (!all.length) return 0;
    var s = Float64Array.from(all).sort();
    return s[Math.min(s.length - 1, Math.floor(q * (s.length - 1)))];
  }
  function tOf(sc, x) {
    if (!(sc.hi > sc.lo)) return 0;
    if (sc.signed) return Math.max(-1, Math.min(1, x / sc.hi));
    return Math.max(0, Math.min(1, (x - sc.lo) / (sc.hi - sc.lo)));
  }
  function rgbOf(sc, t) {
    var L = lut(sc.signed ? "diverging" : S.cmap), i = Math.round((sc.signed ? (t + 1) / 2 : t) * 255) * 3;
    return [L[i], L[i + 1], L[i + 2]];
  }
  function tokenBg(sc, t) {
    if (t >= 0) return "rgba(215,48,39," + t.toFixed(3) + ")";
    return "rgba(49,104,212," + (-t).toFixed(3) + ")";
  }

  // ------------------------------------------------------------------ which row is shown
  var ALL = "*";  // the method switcher's "all side by side" choice
  function M() { return S.method === ALL ? DATA.methods[0] : S.method; }
  function mapOf(ex, key) { return ex.maps[key || M()] || null; }
  function current(ex, key) {
    var m = mapOf(ex, key);
    if (!m) return null;
    if (m.layers && S.layer < LAYERS) {
      var L = m.layers.a.length, k = Math.min(S.layer, L);
      return { v: rows(m.layers).row(k - 1), what: "after layer " + k + " of " + L, m: m };
    }
    return { v: rows(m.final).row(0), what: m.layers ? "final (layer " + m.layers.a.length + ")" : "final", m: m };
  }
  function sharedRows(m) {
    if (S.scale !== "layers" || !m.layers) return null;
    var R = rows(m.layers), out = [rows(m.final).row(0)];
    for (var r = 0; r < R.count; r++) out.push(R.row(r));
    return out;
  }
  function skipSet(ex) { return ex.skip && ex.skip.length ? new Set(ex.skip) : null; }

  // ------------------------------------------------------------------ readout (the value under the pointer)
  function readout(card) {
    var box = el("div", "readout"), where = el("span", "where", "point at the map for its value"),
        val = el("b", "v");
    box.appendChild(where); box.appendChild(document.createTextNode(" ")); box.appendChild(val);
    card.appendChild(box);
    return function (text, v) { where.textContent = text; val.textContent = v === undefined ? "" : fmt(v); };
  }

  // ------------------------------------------------------------------ image panels
  function drawGrid(canvas, v, sc) {
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(canvas.width, canvas.height);
    for (var i = 0; i < v.length; i++) {
      var c = rgbOf(sc, tOf(sc, v[i]));
      img.data[i * 4] = c[0]; img.data[i * 4 + 1] = c[1]; img.data[i * 4 + 2] = c[2]; img.data[i * 4 + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
  function drawOutline(canvas, o, W, H) {
    var s = atob(o.data), ctx = canvas.getContext("2d"), sx = W / o.w, sy = H / o.h;
    function inside(x, y) {
      if (x < 0 || y < 0 || x >= o.w || y >= o.h) return false;
      var k = y * o.w + x;
      return (s.charCodeAt(k >> 3) >> (7 - (k & 7))) & 1;
    }
    ctx.beginPath();
    for (var y = 0; y < o.h; y++) for (var x = 0; x < o.w; x++) {
      if (!inside(x, y)) continue;
      if (!inside(x - 1, y)) { ctx.moveTo(x * sx, y * sy); ctx.lineTo(x * sx, (y + 1) * sy); }
      if (!inside(x + 1, y)) { ctx.moveTo((x + 1) * sx, y * sy); ctx.lineTo((x + 1) * sx, (y + 1) * sy); }
      if (!inside(x, y - 1)) { ctx.moveTo(x * sx, y * sy); ctx.lineTo((x + 1) * sx, y * sy); }
      if (!inside(x, y + 1)) { ctx.moveTo(x * sx, (y + 1) * sy); ctx.lineTo((x + 1) * sx, (y + 1) * sy); }
    }
    ctx.lineWidth = 3; ctx.strokeStyle = "rgba(0,0,0,0.6)"; ctx.stroke();
    ctx.lineWidth = 1.5; ctx.strokeStyle = "#fff"; ctx.stroke();
  }
  function imagePanel(ex, panel, host, say) {
    var h = ex.grid[0], w = ex.grid[1], size = ex.size || [w * 40, h * 40];
    var k = 320 / Math.max(size[0], size[1]), W = Math.round(size[0] * k), H = Math.round(size[1] * k);
    var box = el("figure", "panel"), cap = el("figcaption"), stack = el("div", "stack"), scale = el("div", "scale");
    stack.style.width = W + "px"; stack.style.height = H + "px";
    if (ex.image) {
      var im = el("img", "base"); im.alt = "input image"; im.src = ex.image;
      if (size[0] <= 160) im.classList.add("px");
      stack.appendChild(im);
    }
    var cv = el("canvas", "map"); cv.width = w; cv.height = h; stack.appendChild(cv);
    var oc = null;
    if (ex.outline) { oc = el("canvas", "outline"); oc.width = W; oc.height = H; stack.appendChild(oc); drawOutline(oc, ex.outline, W, H); }
    box.appendChild(cap); box.appendChild(stack); box.appendChild(scale); host.appendChild(box);
    var cur = null;
    function update() {
      cur = current(ex, panel[1]);
      cap.textContent = (panel[0] || M()) + (cur ? " · " + cur.what : "");
      cv.style.opacity = S.opacity; cv.classList.toggle("px", !S.smooth);
      if (oc) oc.style.display = S.outline ? "" : "none";
      if (!cur) { cv.style.visibility = "hidden"; scale.textContent = "not computed for this method"; return; }
      cv.style.visibility = "";
      var sc = scaleOf(cur.v, panel[2] || cur.m.signed, null, sharedRows(cur.m));
      drawGrid(cv, cur.v, sc);
      scale.textContent = "colour: " + fmt(sc.lo) + " → " + fmt(sc.hi);
    }
    stack.addEventListener("mousemove", function (e) {
      if (!cur) return;
      var r = stack.getBoundingClientRect();
      var col = Math.min(w - 1, Math.max(0, Math.floor((e.clientX - r.left) / r.width * w)));
      var row = Math.min(h - 1, Math.max(0, Math.floor((e.clientY - r.top) / r.height * h)));
      say((panel[0] || M()) + " · " + cur.what + " · patch (row " + row + ", col " + col + "):", cur.v[row * w + col]);
    });
    return { update: update, canvas: cv };
  }

  // ------------------------------------------------------------------ token panels
  function tokenStrip(ex, tokens, host, idx) {
    // Render tokens idx (array of indices) into host, CHUNK at a time; returns the spans (filled as they come).
    var spans = new Array(idx.length), done = 0, waiting = [];
    function step() {
      var frag = document.createDocumentFragment(), end = Math.min(idx.length, done + CHUNK);
      for (var k = done; k < end; k++) {
        var s = el("span", "t", tokens[idx[k]]); s.dataset.i = idx[k]; spans[k] = s; frag.appendChild(s);
      }
      host.appendChild(frag);
      var from = done; done = end;
      waiting.forEach(function (f) { f(from, end); });
      if (done < idx.length) later(step);
    }
    return { spans: spans, start: step, done: function () { return done; },
             onChunk: function (f) { waiting.push(f); } };
  }
  function colourSpans(strip, v, sc, skip, from, to) {
    for (var k = from; k < to; k++) {
      var s = strip.spans[k], i = +s.dataset.i;
      s.style.background = skip && skip.has(i) ? "transparent" : tokenBg(sc, tOf(sc, v[i]));
    }
  }
  function hoverTokens(host, ex, getV, label, say) {
    host.addEventListener("mouseover", function (e) {
      var s = e.target.closest ? e.target.closest(".t") : null;
      if (!s || !host.contains(s)) return;
      var got = getV(), i = +s.dataset.i;
      if (got) say(label() + " · token " + JSON.stringify(ex.tokens[i]) + " (#" + i + "):", got.v[i]);
    });
  }
  function tokenPanel(ex, panel, host, say) {
    var box = el("div", "panel tokens"), cap = el("div", "cap"), strip = el("div", "toks"), scale = el("div", "scale");
    box.appendChild(cap); box.appendChild(strip); box.appendChild(scale); host.appendChild(box);
    var idx = ex.tokens.map(function (_, i) { return i; }), skip = skipSet(ex), cur = null, sc = null;
    var ts = tokenStrip(ex, ex.tokens, strip, idx);
    ts.onChunk(function (a, b) { if (cur) colourSpans(ts, cur.v, sc, skip, a, b); });
    function update() {
      cur = current(ex, panel[1]);
      cap.textContent = (panel[0] || M()) + (cur ? " · " + cur.what : " · not computed for this method");
      if (!cur) return;
      sc = scaleOf(cur.v, panel[2] || cur.m.signed, skip, sharedRows(cur.m));
      colourSpans(ts, cur.v, sc, skip, 0, ts.done());
      scale.textContent = "colour: " + fmt(sc.lo) + " → " + fmt(sc.hi) + (skip ? " (special tokens uncoloured)" : "");
    }
    hoverTokens(strip, ex, function () { return cur; }, function () { return (panel[0] || M()) + " · " + cur.what; }, say);
    ts.start();
    return { update: update };
  }

  // Long prompts: caller segments, ranked by their share of the positive relevance; bodies built on opening.
  function segmentPanel(ex, host, say) {
    var box = el("div", "panel segments"), cap = el("div", "cap"), list = el("div", "seglist");
    box.appendChild(cap); box.appendChild(list); host.appendChild(box);
    var skip = skipSet(ex), cur = null, sc = null;
    var segs = ex.segments.map(function (s, k) {
      var d = el("details", "seg"), sum = el("summary"), body = el("div", "toks");
      d.dataset.k = k; d.appendChild(sum); d.appendChild(body); list.appendChild(d);
      var idx = []; for (var i = s[1]; i < s[2]; i++) idx.push(i);
      var g = { s: s, d: d, sum: sum, body: body, idx: idx, strip: null, share: 0 };
      d.addEventListener("toggle", function () {
        if (d.open && !g.strip) {
          g.strip = tokenStrip(ex, ex.tokens, body, idx);
          g.strip.onChunk(function (a, b) { if (cur) colourSpans(g.strip, cur.v, sc, skip, a, b); });
          g.strip.start();
        }
      });
      hoverTokens(body, ex, function () { return cur; }, function () { return M() + " · " + cur.what + " · " + s[0]; }, say);
      return g;
    });
    function update() {
      cur = current(ex, null);
      cap.textContent = M() + (cur ? " · " + cur.what : " · not computed for this method") +
        " · " + segs.length + " segments ranked by their share of the positive relevance (click to open)";
      if (!cur) return;
      sc = scaleOf(cur.v, cur.m.signed, skip, sharedRows(cur.m));
      var total = 0;
      segs.forEach(function (g) {
        g.share = 0;
        g.idx.forEach(function (i) { if (!(skip && skip.has(i)) && cur.v[i] > 0) g.share += cur.v[i]; });
        total += g.share;
      });
      var ranked = segs.slice().sort(function (a, b) { return b.share - a.share || a.s[1] - b.s[1]; });
      ranked.forEach(function (g, r) {
        g.d.dataset.rank = r + 1;
        g.sum.textContent = "#" + (r + 1) + "  " + g.s[0] + " — " + (total > 0 ? (100 * g.share / total).toFixed(1) : "0.0") +
          "% · " + g.idx.length + " tokens";
        list.appendChild(g.d);
        if (g.strip) colourSpans(g.strip, cur.v, sc, skip, 0, g.strip.done());
      });
    }
    later(function () { var top = list.firstChild; if (top && !top.open) top.open = true; });
    return { update: update };
  }

  // ------------------------------------------------------------------ encoder-decoder matrix
  function matrixPanel(ex, host, say) {
    // A decoder's generation attribution names its rows "generated token" and its sources run on into the
    // generated tokens (from index first_generated on); an encoder-decoder's rows are target positions.
    var gen = ex.row_label === "generated token", what = gen ? "generated token" : "target";
    var box = el("div", "panel matrix"), cap = el("div", "cap"), cv = el("canvas", "mat"),
        tl = el("div", "cap", gen ? "generated tokens (click one to see its map over the prompt and the tokens generated before it):"
                                  : "target tokens (click one to see its map over the source):"), tgt = el("div", "toks tgt"),
        sl = el("div", "cap", gen ? "source tokens (the prompt, then the generated ones):" : "source tokens:"),
        src = el("div", "toks"), scale = el("div", "scale"), gallery = el("div", "panels imgs");
    [cap, cv, tl, tgt, gallery, sl, src, scale].forEach(function (x) { box.appendChild(x); });
    host.appendChild(box);
    // A VLM's answer: one map per image under the matrix, showing the selected generated token's row.
    var pics = (ex.images || []).map(function (im) { return answerImage(im, gallery, say); }),
        imgCols = new Set(ex.image_columns || []);
    var P = ex.positions, nS = ex.tokens.length, sel = P.length - 1, skip = skipSet(ex);
    cv.width = nS; cv.height = P.length;
    var cell = Math.max(4, Math.min(18, Math.floor(640 / Math.max(nS, 1))));
    cv.style.width = nS * cell + "px"; cv.style.height = P.length * cell + "px";
    var tIdx = ex.target_tokens.map(function (_, i) { return i; });
    var srcStrip = tokenStrip(ex, ex.tokens, src, ex.tokens.map(function (_, i) { return i; }));
    var tgtStrip = tokenStrip(ex, ex.target_tokens, tgt, tIdx);
    srcStrip.onChunk(function (a, b) {
      if (gen) for (var k = a; k < b; k++) if (+srcStrip.spans[k].dataset.i >= ex.first_generated) srcStrip.spans[k].classList.add("gen");
      for (var j = a; j < b; j++) if (imgCols.has(+srcStrip.spans[j].dataset.i)) srcStrip.spans[j].classList.add("img");
      update();
    });
    tgtStrip.onChunk(function () { update(); });
    srcStrip.start(); tgtStrip.start();
    function m() { return ex.maps[M()] || null; }
    function update() {
      var e = m();
      cap.textContent = M() + (gen ? " · generated × source (row t = the prediction of generated token t)"
                                   : " · source × target (row = explained target position)");
      if (!e) { scale.textContent = "not computed for this method"; return; }
      var R = rows(e.rows), all = [];
      for (var r = 0; r < R.count; r++) all.push(R.row(r));
      var sc = scaleOf(all[0], e.signed, skip, all), flat = new Float64Array(R.count * nS);
      all.forEach(function (row, r) { flat.set(row, r * nS); });
      drawGrid(cv, flat, sc);
      colourSpans(srcStrip, all[sel], scaleOf(all[sel], e.signed, skip), skip, 0, srcStrip.done());
      var trow = e.target ? rows(e.target).row(sel) : null;
      tgtStrip.spans.forEach(function (s, k) {
        var pos = P.indexOf(k);
        s.classList.toggle("sel", pos === sel); s.classList.toggle("click", pos >= 0);
        s.style.background = trow ? tokenBg(scaleOf(trow, false, null), tOf(scaleOf(trow, false, null), trow[k])) : "";
      });
      scale.textContent = "matrix colour: " + fmt(sc.lo) + " → " + fmt(sc.hi) + " · selected " + what + ": " +
        JSON.stringify(ex.target_tokens[P[sel]]) + " (position " + P[sel] + ")";
      pics.forEach(function (p) { p.draw(sel, what + " " + JSON.stringify(ex.target_tokens[P[sel]]) + " (#" + P[sel] + ")"); });
    }
    tgt.addEventListener("click", function (e) {
      var s = e.target.closest(".t"); if (!s) return;
      var pos = P.indexOf(+s.dataset.i); if (pos >= 0) { sel = pos; update(); }
    });
    cv.addEventListener("click", function (e) {
      var r = cv.getBoundingClientRect(); sel = Math.min(P.length - 1, Math.floor((e.clientY - r.top) / r.height * P.length)); update();
    });
    cv.addEventListener("mousemove", function (e) {
      var q = m(); if (!q) return;
      var r = cv.getBoundingClientRect(), c = Math.min(nS - 1, Math.floor((e.clientX - r.left) / r.width * nS)),
          t = Math.min(P.length - 1, Math.floor((e.clientY - r.top) / r.height * P.length));
      say(M() + " · " + what + " " + JSON.stringify(ex.target_tokens[P[t]]) + " (#" + P[t] + ") × source " +
          JSON.stringify(ex.tokens[c]) + " (#" + c + "):", rows(q.rows).row(t)[c]);
    });
    hoverTokens(src, ex, function () { var q = m(); return q ? { v: rows(q.rows).row(sel) } : null; },
                function () { return M() + " · source of " + what + " #" + P[sel]; }, say);
    return { update: update };
  }

  // One image of a VLM's answer: the picture, and over it the map of the selected generated token's row.
  function answerImage(im, host, say) {
    var h = im.grid[0], w = im.grid[1], size = im.size;
    var k = 320 / Math.max(size[0], size[1]), W = Math.round(size[0] * k), H = Math.round(size[1] * k);
    var box = el("figure", "panel answer-image"), cap = el("figcaption"), stack = el("div", "stack"),
        scale = el("div", "scale");
    stack.style.width = W + "px"; stack.style.height = H + "px";
    if (im.image) {
      var base = el("img", "base"); base.alt = im.label; base.src = im.image;
      if (size[0] <= 160) base.classList.add("px");
      stack.appendChild(base);
    }
    var cv = el("canvas", "map"); cv.width = w; cv.height = h; stack.appendChild(cv);
    box.appendChild(cap); box.appendChild(stack); box.appendChild(scale); host.appendChild(box);
    var R = rows(im.rows), cur = null, label = "";
    function draw(t, what) {
      cur = R.row(t); label = im.label + " · " + what;
      cv.style.opacity = S.opacity; cv.classList.toggle("px", !S.smooth);
      var sc = scaleOf(cur, false, null), tot = 0;
      for (var i = 0; i < cur.length; i++) tot += cur[i];
      drawGrid(cv, cur, sc);
      cap.textContent = label;
      scale.textContent = "colour: " + fmt(sc.lo) + " → " + fmt(sc.hi) + " · the map holds " + fmt(tot) + " of the row";
    }
    stack.addEventListener("mousemove", function (e) {
      if (!cur) return;
      var r = stack.getBoundingClientRect();
      var col = Math.min(w - 1, Math.max(0, Math.floor((e.clientX - r.left) / r.width * w)));
      var row = Math.min(h - 1, Math.max(0, Math.floor((e.clientY - r.top) / r.height * h)));
      say(label + " · patch (row " + row + ", col " + col + "):", cur[row * w + col]);
    });
    return { draw: draw, canvas: cv };
  }

  // ------------------------------------------------------------------ per-head grid
  function headsOf(ex) {
    if (ex.maps[M()] && ex.maps[M()].heads) return [M(), ex.maps[M()].heads];
    for (var k in ex.maps) if (ex.maps[k].heads) return [k, ex.maps[k].heads];
    return null;
  }
  function headsPanel(ex, card, say) {
    if (!headsOf(ex)) return null;
    var d = el("details", "heads"), sum = el("summary"), grid = el("div", "hgrid");
    d.appendChild(sum); d.appendChild(grid); card.appendChild(d);
    function update() {
      var got = headsOf(ex), R = rows(got[1]);
      sum.textContent = "per head: " + R.count + " heads (" + got[0] + ", each on its own scale)";
      if (!d.open) return;
      grid.textContent = "";
      for (var hd = 0; hd < R.count; hd++) grid.appendChild(oneHead(ex, got[0], hd, R.row(hd), say));
    }
    d.addEventListener("toggle", update);
    return { update: update };
  }
  function oneHead(ex, name, hd, v, say) {
    var f = el("figure", "head"), cv = el("canvas"), img = ex.kind === "image";
    var w = img ? ex.grid[1] : v.length, h = img ? ex.grid[0] : 1;
    cv.width = w; cv.height = h; cv.className = img ? "hmap" : "hstrip";
    drawGrid(cv, v, scaleOf(v, false, skipSet(ex)));
    f.appendChild(el("figcaption", null, "head " + hd)); f.appendChild(cv);
    cv.addEventListener("mousemove", function (e) {
      var r = cv.getBoundingClientRect(), c = Math.min(w - 1, Math.floor((e.clientX - r.left) / r.width * w)),
          row = Math.min(h - 1, Math.floor((e.clientY - r.top) / r.height * h));
      say(name + " · head " + hd + (img ? " · patch (row " + row + ", col " + c + "):" : " · token " + JSON.stringify(ex.tokens[c]) + ":"), v[row * w + c]);
    });
    return f;
  }

  // ------------------------------------------------------------------ controls
  function control(bar, label, input) {
    var l = el("label", "ctl"); l.appendChild(el("span", null, label)); l.appendChild(input); bar.appendChild(l);
    return input;
  }
  function select(id, options, value) {
    var s = el("select"); s.id = id;
    options.forEach(function (o) { var op = el("option", null, o[1]); op.value = o[0]; s.appendChild(op); });
    s.value = value;
    return s;
  }
  function controls() {
    var bar = el("div", "bar"), kinds = DATA.examples.map(function (e) { return e.kind; });
    var hasImage = kinds.indexOf("image") >= 0 || kinds.indexOf("matrix") >= 0;
    if (!DATA.fixed) {
      var choices = DATA.methods.map(function (m) { return [m, m]; });
      var sideBySide = DATA.methods.length > 1 && DATA.examples.some(function (e) { return e.kind !== "matrix" && !e.segments; });
      if (sideBySide) choices.push([ALL, "all side by side"]);
      control(bar, "method", select("ar-method", choices, S.method))
        .addEventListener("change", function (e) { S.method = e.target.value; redraw(); });
    }
    if (LAYERS > 0) {
      var r = el("input"); r.type = "range"; r.id = "ar-layer"; r.min = 1; r.max = LAYERS; r.step = 1; r.value = LAYERS;
      var lab = el("span", "lval");
      control(bar, "layer", r).parentNode.appendChild(lab);
      var show = function () { lab.textContent = S.layer < LAYERS ? "after layer " + S.layer : "final (" + LAYERS + ")"; };
      r.addEventListener("input", function () { S.layer = +r.value; show(); redraw(); });
      show();
    }
    var scales = [["max", "each map: 0 → max"], ["minmax", "each map: min → max"], ["layers", "one scale over the layers"],
                  ["p99", "each map: 0 → 99th percentile"]];
    control(bar, "scale", select("ar-scale", scales, S.scale))
      .addEventListener("change", function (e) { S.scale = e.target.value; redraw(); });
    if (hasImage) {
      control(bar, "colours", select("ar-cmap", Object.keys(ANCHORS).filter(function (k) { return k !== "diverging"; })
        .map(function (k) { return [k, k]; }), S.cmap)).addEventListener("change", function (e) { S.cmap = e.target.value; redraw(); });
      var op = el("input"); op.type = "range"; op.id = "ar-opacity"; op.min = 0; op.max = 1; op.step = 0.05; op.value = S.opacity;
      control(bar, "opacity", op).addEventListener("input", function () { S.opacity = +op.value; redraw(); });
      var sm = el("input"); sm.type = "checkbox"; sm.id = "ar-smooth"; sm.checked = S.smooth;
      control(bar, "smooth", sm).addEventListener("change", function () { S.smooth = sm.checked; redraw(); });
      if (DATA.examples.some(function (e) { return e.outline; })) {
        var ol = el("input"); ol.type = "checkbox"; ol.id = "ar-outline"; ol.checked = S.outline;
        control(bar, "outline", ol).addEventListener("change", function () { S.outline = ol.checked; redraw(); });
      }
    }
    return bar;
  }

  // ------------------------------------------------------------------ cards
  // An example's panels: its own (one following the switcher, or the audit's fixed three); with "all side by
  // side" one per method instead, built the first time they are asked for.
  function panelGroup(ex, host, say) {
    function make(list) {
      var box = el("div", "group");
      host.appendChild(box);
      return { box: box, views: list.map(function (p) {
        return ex.kind === "image" ? imagePanel(ex, p, box, say) : tokenPanel(ex, p, box, say);
      }) };
    }
    var own = make(ex.panels), all = null;
    function update() {
      var wide = S.method === ALL && !DATA.fixed;
      if (wide && !all) all = make(DATA.methods.filter(function (m) { return ex.maps[m]; })
                                     .map(function (m) { return [m, m, null]; }));
      own.box.style.display = wide ? "none" : "";
      if (all) all.box.style.display = wide ? "" : "none";
      (wide ? all : own).views.forEach(function (v) { v.update(); });
    }
    return { update: update };
  }
  function card(ex, i) {
    var c = el("section", ex.kind === "image" ? "card" : "card wide"); c.id = "ar-ex-" + i;
    c.appendChild(el("h2", null, ex.label));
    var panels = el("div", "panels"); c.appendChild(panels);
    var say = readout(c), made = [];
    if (ex.kind === "matrix") made.push(matrixPanel(ex, panels, say));
    else if (ex.kind === "tokens" && ex.segments) made.push(segmentPanel(ex, panels, say));
    else made.push(panelGroup(ex, panels, say));
    var hp = ex.kind !== "matrix" ? headsPanel(ex, c, say) : null;
    if (hp) made.push(hp);
    return { node: c, views: made };
  }
  function redraw() {
    for (var i = 0; i < views.length; i++) views[i].update();
  }

  function main() {
    var head = el("header");
    head.appendChild(el("h1", null, DATA.title || "attnroll viewer"));
    if (DATA.notes) head.appendChild(el("p", "notes", DATA.notes));
    app.textContent = "";
    app.appendChild(head);
    app.appendChild(controls());
    var list = el("main");
    app.appendChild(list);
    DATA.examples.forEach(function (ex, i) {
      var c = card(ex, i);
      list.appendChild(c.node);
      views = views.concat(c.views);
    });
    redraw();
    window.attnroll = { state: S, redraw: redraw, data: DATA, ready: performance.now() };
    document.body.setAttribute("data-ready", "1");
  }
  main();
})();
